#pragma once

// A regular file opened for reading at offsets (pread), for the readers
// of the checkpoint formats (tensor files, safetensors): every failure an
// InvalidArgument "<what>: <problem>".

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/enforce.h"
#include "dtrain/errors.h"

namespace dtrain::checkpoint {

// Not in an anonymous namespace: a member of the readers' Impl classes
// (gcc warns of a class with a member of internal linkage once a file is
// part of a unity batch).
namespace tensor_file_io {

class File {
 public:
  explicit File(const std::string& what, const std::string& path) : what_(what) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    DTRAIN_CHECK_ARG(fd_ >= 0, what_, ": cannot open: ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw InvalidArgument(what_ + ": not a regular file");
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~File() { ::close(fd_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  uint64_t size() const { return size_; }

  void read(uint64_t offset, size_t n, void* out) const {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, std::min<size_t>(n, 1u << 30), static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      DTRAIN_CHECK_ARG(got >= 0, what_, ": cannot read: ", std::strerror(errno));
      DTRAIN_CHECK_ARG(got > 0, what_, ": truncated while being read");
      p += got;
      n -= static_cast<size_t>(got);
      offset += static_cast<uint64_t>(got);
    }
  }

 private:
  std::string what_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

}  // namespace tensor_file_io

}  // namespace dtrain::checkpoint
