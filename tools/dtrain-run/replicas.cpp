#include "replicas.h"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>

#include "common/env.h"
#include "dtrain/ft/lighthouse.h"
#include "signals.h"

extern char** environ;

namespace dtrain::run {
namespace {

using Clock = std::chrono::steady_clock;

// One replica's launcher, and its output on the way to ours.
struct Replica {
  std::string id;
  pid_t pid = -1;
  int fds[2] = {-1, -1};         // the read ends of its stdout and stderr
  std::string pending[2];        // a line not yet ended
  bool exited = false;
  int status = 0;                // waitpid's
  Clock::time_point exited_at;
};

std::string self_path() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error(std::string("cannot find this program (/proc/self/exe): ") + strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

// A replica's dtrain-run: our flags less --replicas, with --standalone (a
// rendezvous of its own on this node), then the program and its arguments.
std::vector<std::string> replica_argv(const Options& o, const std::string& self) {
  std::vector<std::string> argv{self};
  bool standalone = false;
  for (size_t i = 0; i < o.launcher_args.size(); ++i) {
    const std::string& a = o.launcher_args[i];
    if (a == "--replicas") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--replicas=", 0) == 0) continue;
    standalone = standalone || a == "--standalone";
    argv.push_back(a);
  }
  if (!standalone) argv.push_back("--standalone");
  argv.push_back("--");
  argv.push_back(o.program);
  argv.insert(argv.end(), o.args.begin(), o.args.end());
  return argv;
}

// Our environment with the replica's id and the lighthouse's address.
std::vector<std::string> replica_env(const std::string& id, const std::string& lighthouse) {
  const std::string id_var = env::kFtReplicaId.name, lighthouse_var = env::kFtLighthouse.name;
  std::vector<std::string> out;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (name != id_var && name != lighthouse_var) out.push_back(kv);
  }
  out.push_back(id_var + "=" + id);
  out.push_back(lighthouse_var + "=" + lighthouse);
  return out;
}

void spawn(Replica& r, const std::vector<std::string>& argv_s, const std::vector<std::string>& env_s) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + strerror(errno));
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    throw std::runtime_error(std::string("pipe: ") + strerror(errno));
  }
  // Everything the child needs is prepared before fork (only
  // async-signal-safe calls are allowed after it).
  std::vector<std::string> argv_copy = argv_s, env_copy = env_s;
  std::vector<char*> argv, envp;
  for (auto& a : argv_copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_copy) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + strerror(errno));
  if (pid == 0) {
    // Its own process group (a terminal's Ctrl-C reaches it through us),
    // and stopped with its workers when we die.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(out[1]);
  ::close(err[1]);
  r.pid = pid;
  r.fds[0] = out[0];
  r.fds[1] = err[0];
}

// Passes on the complete lines of pending + data, each prefixed with the
// replica's id; at the end of the stream (data == nullptr) the rest too.
void relay(const std::string& id, std::string& pending, const char* data, size_t n, FILE* stream) {
  if (data) pending.append(data, n);
  size_t start = 0;
  for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1)
    std::fprintf(stream, "%s: %.*s\n", id.c_str(), static_cast<int>(nl - start), pending.data() + start);
  pending.erase(0, start);
  if (!data && !pending.empty()) {
    std::fprintf(stream, "%s: %s\n", id.c_str(), pending.c_str());
    pending.clear();
  }
  std::fflush(stream);
}

void close_stream(Replica& r, int which) {
  relay(r.id, r.pending[which], nullptr, 0, which == 0 ? stdout : stderr);
  ::close(r.fds[which]);
  r.fds[which] = -1;
}

// Reads what the replicas wrote, for up to `timeout`.
void pump(std::vector<Replica>& replicas, std::chrono::milliseconds timeout) {
  std::vector<pollfd> polled;
  std::vector<std::pair<Replica*, int>> owner;
  for (auto& r : replicas)
    for (int which = 0; which < 2; ++which)
      if (r.fds[which] >= 0) {
        polled.push_back({r.fds[which], POLLIN, 0});
        owner.emplace_back(&r, which);
      }
  if (polled.empty()) {
    std::this_thread::sleep_for(timeout);
    return;
  }
  if (::poll(polled.data(), polled.size(), static_cast<int>(timeout.count())) <= 0) return;
  char buf[65536];
  for (size_t i = 0; i < polled.size(); ++i) {
    if (!(polled[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    auto [r, which] = owner[i];
    const ssize_t n = ::read(r->fds[which], buf, sizeof(buf));
    if (n > 0) relay(r->id, r->pending[which], buf, static_cast<size_t>(n), which == 0 ? stdout : stderr);
    else if (n == 0 || errno != EINTR) close_stream(*r, which);
  }
}

// Reaps the replicas' launchers that ended; the streams of one that ended
// are closed after a grace (a process it left behind may hold them).
void reap(std::vector<Replica>& replicas) {
  for (auto& r : replicas) {
    if (!r.exited && ::waitpid(r.pid, &r.status, WNOHANG) == r.pid) {
      r.exited = true;
      r.exited_at = Clock::now();
    }
    if (r.exited && Clock::now() - r.exited_at > std::chrono::seconds(2))
      for (int which = 0; which < 2; ++which)
        if (r.fds[which] >= 0) close_stream(r, which);
  }
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by " + signal_name(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// The verdict on the replicas: 0 when each succeeded, else 1.
int summarize(const std::vector<Replica>& replicas) {
  std::ostringstream failed, finished;
  int failures = 0;
  for (const auto& r : replicas) {
    if (WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0) {
      finished << (finished.tellp() > 0 ? ", " : "") << r.id;
      continue;
    }
    ++failures;
    failed << (failed.tellp() > 0 ? "; " : "") << r.id << " failed (" << describe_exit(r.status) << ")";
  }
  if (failures == 0) {
    std::cerr << "dtrain-run: all " << replicas.size() << " replicas finished" << std::endl;
    return 0;
  }
  std::cerr << "dtrain-run: " << failed.str()
            << (failures < static_cast<int>(replicas.size()) ? "; finished: " + finished.str() : std::string())
            << std::endl;
  return 1;
}

}  // namespace

int run_replicas(const Options& o) {
  start_signal_watch();  // before the lighthouse's threads, which inherit the blocked mask
  std::vector<Replica> replicas(static_cast<size_t>(o.replicas));
  std::unique_ptr<ft::Lighthouse> lighthouse;
  std::string address = env::get(env::kFtLighthouse).value_or("");
  try {
    if (address.empty()) {
      lighthouse = std::make_unique<ft::Lighthouse>(ft::LighthouseOptions().host("127.0.0.1").port(0));
      address = lighthouse->address();
      std::cerr << "dtrain-run: lighthouse serving on " << address << " for " << o.replicas << " replicas" << std::endl;
    }
    const auto argv = replica_argv(o, self_path());
    for (int k = 0; k < o.replicas; ++k) {
      replicas[k].id = "replica-" + std::to_string(k);
      spawn(replicas[k], argv, replica_env(replicas[k].id, address));
    }
  } catch (const std::exception& e) {
    std::cerr << "dtrain-run: --replicas: " << e.what() << std::endl;
    for (auto& r : replicas)
      if (r.pid > 0) ::kill(r.pid, SIGTERM);
    for (auto& r : replicas)
      if (r.pid > 0) ::waitpid(r.pid, &r.status, 0);
    return 1;
  }
  int passed_on = 0;
  for (;;) {
    pump(replicas, std::chrono::milliseconds(100));
    reap(replicas);
    if (int sig = pending_signal(); sig && !passed_on) {
      passed_on = sig;
      std::cerr << "dtrain-run: received " << signal_name(sig) << "; passing it on to the replicas" << std::endl;
      for (auto& r : replicas)
        if (!r.exited) ::kill(r.pid, sig);
    }
    bool done = true;
    for (const auto& r : replicas) done = done && r.exited && r.fds[0] < 0 && r.fds[1] < 0;
    if (done) break;
  }
  const int verdict = summarize(replicas);
  return passed_on ? 128 + passed_on : verdict;
}

}  // namespace dtrain::run
