// dtrain-run: a torchrun-compatible launcher. See docs/launcher.md.

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <sstream>

#include "agent.h"
#include "options.h"

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

int main(int argc, char** argv) {
  auto options = dtrain::run::parse_options(argc, argv);
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
  return dtrain::run::run_agent(options);
}
