// libFuzzer harness: dtrain-run's command line (torchrun's flags, their
// PET_ variables' values, --rdzv-conf, --redirects/--tee maps, nproc
// "auto"/"gpu"/"cpu"). Each input is argv after the program name, its
// arguments separated by NUL bytes. parse_options() must return Options or
// throw UsageError naming the problem; any other exception (an unchecked
// std::stoi, say) would end the real launcher with std::terminate, so it is
// not caught here and fails the run, as does a crash or sanitizer report.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "options.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"dtrain-run"};
  std::string current;
  for (size_t i = 0; i < size && args.size() < 64; ++i) {
    if (data[i] == 0) {
      args.push_back(current);
      current.clear();
    } else {
      current.push_back(static_cast<char>(data[i]));
    }
  }
  if (!current.empty()) args.push_back(current);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  try {
    (void)dtrain::run::parse_options(static_cast<int>(args.size()), argv.data());
  } catch (const dtrain::run::UsageError&) {
    // bad input, named: what the launcher prints before it exits 2
  }
  return 0;
}
