// libFuzzer harness: dtrain-run's reader of workers' error files
// (TORCHELASTIC_ERROR_FILE), which a worker — any program — writes. Each
// input is the whole file. read_error_file() must return a report (a
// message, or a problem naming why the file cannot be used) without
// throwing; a crash, a sanitizer report or a message beyond its caps
// (30 lines, 8 KiB plus the cut marker) is a bug. Seeds: fuzz/make_seeds.py.

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "error_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/dev/shm/dtrain-error-file-fuzz-" + std::to_string(getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  const auto report = dtrain::run::read_error_file(path);
  if (!report) std::abort();  // the file is there
  if (report->message.size() > (8 << 10) + 16) std::abort();
  if (report->problem.empty() == false && !report->message.empty()) std::abort();
  ::unlink(path.c_str());
  return 0;
}
