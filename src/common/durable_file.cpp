#include "common/durable_file.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "dtrain/errors.h"

namespace dtrain::files {
namespace {

// Callers pass errno as read right after the failed call.
[[noreturn]] void fail(const char* step, const std::string& file, int err) {
  throw Error(std::string("cannot ") + step + " " + file + ": " + std::strerror(err));
}

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

void fsync_directory(const std::string& path) {
  const std::string dir = dir_of(path);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open directory", dir, errno);
  const int synced = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // The new file is in place but its name may not survive a crash.
  if (synced != 0) fail("fsync directory", dir, err);
}

}  // namespace

void Sink::write(const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    size_t n = bytes;
    if (written_ < kill_at_ && kill_at_ - written_ < n) n = static_cast<size_t>(kill_at_ - written_);
    if (written_ == kill_at_) raise(SIGKILL);  // test hook: a crash in the middle of writing
    const ssize_t done = ::write(fd_, p, std::min<size_t>(n, 1u << 30));
    if (done < 0 && errno == EINTR) continue;
    if (done < 0) fail("write", tmp_, errno);
    p += done;
    bytes -= static_cast<size_t>(done);
    written_ += static_cast<uint64_t>(done);
  }
}

void replace_durably(const std::string& path, uint64_t total_bytes,
                     const std::function<void(Sink&)>& produce, const WriteFaults& faults) {
  const std::string tmp = path + ".tmp";  // same directory: the rename is atomic
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("create", tmp, errno);
  try {
    Sink sink(fd, tmp,
              faults.die_while_writing ? total_bytes / 2 : std::numeric_limits<uint64_t>::max());
    produce(sink);
    const int synced = faults.fsync_errno != 0 ? (errno = faults.fsync_errno, -1) : ::fsync(fd);
    if (synced != 0) fail("fsync", tmp, errno);
    const int closed = ::close(fd);
    fd = -1;
    if (closed != 0) fail("close", tmp, errno);
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      fail("rename", tmp + " to " + path, err);
    }
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(path);
}

}  // namespace dtrain::files
