#pragma once

// Small helpers shared by the benchmarks: flag parsing, medians, running a
// command and reading "name=value" fields from what it printed.

#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::bench {

struct Args {
  std::map<std::string, std::string> flags;
  std::string get(const std::string& k, const std::string& d) const {
    auto it = flags.find(k);
    return it == flags.end() ? d : it->second;
  }
  int num(const std::string& k, int d) const { return std::stoi(get(k, std::to_string(d))); }
};

inline Args parse(int argc, char** argv, int first) {
  Args a;
  for (int i = first; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument " + k);
    a.flags[k.substr(2)] = argv[i + 1];
  }
  return a;
}

// A "Vm...:" line of /proc/self/status, in bytes.
inline int64_t vm_status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;
  return 0;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// What was measured: the build type, compiler and libtorch of this build
// (the bench is built with the library, in the same build tree).
inline std::string build_line() {
#ifdef DTRAIN_BENCH_BUILD_TYPE
  std::string type = DTRAIN_BENCH_BUILD_TYPE;
#else
  std::string type;
#endif
  if (type.empty()) type = "no build type";
  return "# build: " + type + ", " +
#if defined(__clang__)
         "clang "
#elif defined(__GNUC__)
         "gcc "
#endif
         + std::string(__VERSION__) + ", libtorch " + TORCH_VERSION + ", C++" +
         std::to_string(__cplusplus / 100 % 100);
}

inline std::string self_path() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot find /proc/self/exe");
  buf[n] = 0;
  return buf;
}

// Runs a command and returns what it printed.
inline std::string capture(const std::string& cmd) {
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) throw std::runtime_error("cannot run: " + cmd);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
  int rc = pclose(f);
  if (rc != 0) throw std::runtime_error("command failed (" + std::to_string(rc) + "): " + cmd + "\n" + out);
  return out;
}

// The interpreter of the Python baselines: --python if given, else the
// first of python3 on PATH (a virtual environment's PyTorch) and
// /usr/bin/python3 (Debian's python3-torch) that can import torch.
// The command that runs a Python baseline. The baseline makes its own
// rendezvous, so it must not see the variables of the job this bench may be
// a rank of: PyTorch 2.x's tcp:// rendezvous joins the agent store named by
// MASTER_ADDR/MASTER_PORT as a client when TORCHELASTIC_USE_AGENT_STORE is
// set, and waits there (30 min) for a store that never serves it.
inline std::string python_of(const Args& a) {
  const std::string clean_env =
      "env -u TORCHELASTIC_USE_AGENT_STORE -u TORCHELASTIC_RUN_ID -u RANK -u LOCAL_RANK "
      "-u WORLD_SIZE -u LOCAL_WORLD_SIZE -u GROUP_RANK -u MASTER_ADDR -u MASTER_PORT "
      // PyTorch 2.4+ asks for libuv in its TCPStore, and fails where it
      // was built without it (Debian's 2.6 and 2.14); 1.13 ignores this.
      "USE_LIBUV=0 ";
  const std::string given = a.get("python", "");
  if (!given.empty()) return clean_env + given;
  for (const char* candidate : {"python3", "/usr/bin/python3"}) {
    const std::string probe = std::string(candidate) + " -c 'import torch' >/dev/null 2>&1";
    if (std::system(probe.c_str()) == 0) return clean_env + candidate;
  }
  throw std::runtime_error(
      "no Python with PyTorch for the baseline: neither python3 on PATH nor /usr/bin/python3 "
      "imports torch; pass --python PATH");
}

inline double field(const std::string& text, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(name + "=([0-9.eE+-]+)")))
    throw std::runtime_error("no " + name + "= in output:\n" + text);
  return std::stod(m[1]);
}

}  // namespace dtrain::bench
