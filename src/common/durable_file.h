#pragma once

// Writing a file so that a crash never leaves a partial one under its name:
// the bytes go to `<path>.tmp` in the same directory, which is fsynced,
// renamed over `<path>`, and the directory fsynced, each step checked. On
// any failure the temporary file is removed, `<path>` is untouched, and the
// error names the file and the step: "cannot <step> <file>: <errno text>".

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace dtrain::files {

// Test hooks: a writer that dies half way, an fsync that fails.
struct WriteFaults {
  bool die_while_writing = false;  // SIGKILL after half of `total_bytes`
  int fsync_errno = 0;             // nonzero: fsync of the temporary file fails with it
};

class Sink {
 public:
  void write(const void* data, size_t bytes);

 private:
  friend void replace_durably(const std::string&, uint64_t, const std::function<void(Sink&)>&,
                              const WriteFaults&);
  Sink(int fd, const std::string& tmp, uint64_t kill_at) : fd_(fd), tmp_(tmp), kill_at_(kill_at) {}
  int fd_;
  const std::string& tmp_;
  uint64_t kill_at_;  // bytes; UINT64_MAX: never
  uint64_t written_ = 0;
};

// `produce` writes the content (`total_bytes` of it, used only by the
// faults) to the sink. Throws dtrain::Error on any failed step; an
// exception from `produce` also removes the temporary file.
void replace_durably(const std::string& path, uint64_t total_bytes,
                     const std::function<void(Sink&)>& produce, const WriteFaults& faults = {});

}  // namespace dtrain::files
