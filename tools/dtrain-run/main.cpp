// dtrain-run: a torchrun-compatible launcher. See docs/launcher.md.

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "agent.h"
#include "options.h"
#include "replicas.h"
#include "slurm_defaults.h"

namespace {

// PROGRAM as execve will find it: as given when it has a slash, else on PATH.
std::string locate(const std::string& program) {
  auto executable = [](const std::string& p) {
    struct stat st{};
    return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(p.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) return executable(program) ? program : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':'))
    if (!dir.empty() && executable(dir + "/" + program)) return dir + "/" + program;
  return "";
}

}  // namespace

// --standalone: one node, so the launcher can make the job's token itself
// (docs/security.md). Its store and its workers' clients read it from the
// environment the workers inherit; it never appears in argv or a message.
// A token the user set (DTRAIN_STORE_TOKEN or DTRAIN_STORE_TOKEN_FILE,
// docs/env-vars.md) is kept.
static void give_the_job_a_token() {
  if (std::getenv("DTRAIN_STORE_TOKEN") || std::getenv("DTRAIN_STORE_TOKEN_FILE")) return;
  unsigned char bytes[32];
  std::ifstream random("/dev/urandom", std::ios::binary);
  if (!random.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    std::cerr << "dtrain-run: cannot read /dev/urandom to make the job token" << std::endl;
    std::exit(1);
  }
  static const char* hex = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) token += {hex[b >> 4], hex[b & 15]};
  setenv("DTRAIN_STORE_TOKEN", token.c_str(), 1);
}

int main(int argc, char** argv) {
  dtrain::run::Options options;
  try {
    // Before the flags are parsed: Slurm's values fill the PET_ variables
    // that flags fall back to.
    const auto slurm = dtrain::run::apply_slurm_defaults();
    if (!slurm.empty()) std::cerr << "dtrain-run: " << slurm << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "dtrain-run: " << e.what() << std::endl;
    return 2;
  }
  try {
    options = dtrain::run::parse_options(argc, argv);
  } catch (const dtrain::run::UsageError& e) {
    (e.exit_code == 0 ? std::cout : std::cerr) << e.what() << std::flush;
    return e.exit_code;
  }
  const auto found = locate(options.program);
  if (found.empty()) {
    std::cerr << "dtrain-run: program '" << options.program << "' "
              << (options.program.find('/') != std::string::npos
                      ? "does not exist or is not executable"
                      : "was not found on PATH")
              << std::endl;
    return 2;
  }
  options.program = found;
  // (--replicas: one token for the lighthouse and every replica.)
  if (options.standalone || options.replicas > 0) give_the_job_a_token();
  return options.replicas > 0 ? dtrain::run::run_replicas(options) : dtrain::run::run_agent(options);
}
