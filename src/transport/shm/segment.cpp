#include "transport/shm/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <random>
#include <utility>

#include "common/enforce.h"
#include "common/logging.h"

namespace dtrain::shm {
namespace {

std::string errno_text() { return std::strerror(errno); }

std::string make_name() {
  static std::atomic<unsigned> counter{0};
  std::random_device rd;
  return detail::cat("/", kSegmentPrefix, ::getpid(), ".", counter++, ".", std::hex, rd());
}

void* map(int fd, size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    throw Error(detail::cat("shm: cannot map ", bytes, " bytes of /dev/shm", name, ": ",
                            errno_text()));
  return p;
}

// The lock a probe would conflict with on [start, start+len) (len 0: to the
// end), or F_UNLCK when nobody else holds one.
short probe_lock(int fd, off_t start, off_t len) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = start;
  fl.l_len = len;
  if (::fcntl(fd, F_OFD_GETLK, &fl) != 0) return F_WRLCK;  // cannot tell: assume alive
  return fl.l_type;
}

// Takes (F_WRLCK) or drops (F_UNLCK) the lock of byte `slot`; fcntl's result.
int set_slot_lock(int fd, int slot, short type) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = slot;
  fl.l_len = 1;
  return ::fcntl(fd, F_OFD_SETLK, &fl);
}

}  // namespace

Segment Segment::create(size_t bytes) {
  Segment s;
  s.name_ = make_name();
  s.fd_ = ::shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (s.fd_ < 0)
    throw Error(detail::cat("shm: cannot create /dev/shm", s.name_, ": ", errno_text()));
  s.linked_ = true;
  s.size_ = bytes;
  if (::ftruncate(s.fd_, static_cast<off_t>(bytes)) != 0)
    throw Error(detail::cat("shm: cannot size /dev/shm", s.name_, " to ", bytes, " bytes: ",
                            errno_text(), " (is /dev/shm large enough? see `df -h /dev/shm`)"));
  // Reserve the pages now: on a full tmpfs a first touch would be SIGBUS.
  if (int rc = ::posix_fallocate(s.fd_, 0, static_cast<off_t>(bytes)); rc != 0)
    throw Error(detail::cat("shm: cannot reserve ", bytes, " bytes in /dev/shm for ", s.name_,
                            ": ", std::strerror(rc),
                            " (is /dev/shm large enough? see `df -h /dev/shm`; "
                            "docs/backends.md says what an shm group takes)"));
  s.data_ = map(s.fd_, bytes, s.name_);
  return s;
}

Segment Segment::open(const std::string& name, size_t bytes) {
  Segment s;
  s.name_ = name;
  s.fd_ = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (s.fd_ < 0)
    throw Error(detail::cat("shm: cannot open /dev/shm", name, ": ", errno_text(),
                            " (ranks of an shm group must share one machine and /dev/shm)"));
  struct stat st {};
  if (::fstat(s.fd_, &st) != 0 || static_cast<size_t>(st.st_size) != bytes)
    throw Error(detail::cat("shm: /dev/shm", name, " has ", st.st_size, " bytes, expected ",
                            bytes, " (ranks disagree on the group's size)"));
  s.size_ = bytes;
  s.data_ = map(s.fd_, bytes, name);
  return s;
}

Segment::Segment(Segment&& other) noexcept
    : name_(std::exchange(other.name_, std::string())),
      fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      linked_(std::exchange(other.linked_, false)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::exchange(other.name_, std::string());
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

Segment::~Segment() { release(); }

void Segment::release() noexcept {
  if (linked_) unlink();
  if (data_) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
  name_.clear();
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
}

void Segment::unlink() {
  if (!linked_) return;
  linked_ = false;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
    log_warning(detail::cat("shm: cannot unlink /dev/shm", name_, ": ", errno_text()));
}

void Segment::lock_slot(int slot) {
  if (set_slot_lock(fd_, slot, F_WRLCK) != 0)
    throw Error(detail::cat("shm: rank slot ", slot, " of /dev/shm", name_,
                            " is already taken (two ranks with the same rank number?): ",
                            errno_text()));
}

bool Segment::slot_locked_by_other(int slot) const { return probe_lock(fd_, slot, 1) != F_UNLCK; }

void Segment::unlock_slot(int slot) {
  set_slot_lock(fd_, slot, F_UNLCK);  // nothing to do about a failure: closing drops it too
}

int remove_stale_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (!dir) return 0;
  int removed = 0;
  const std::string prefix = kSegmentPrefix;
  while (dirent* entry = ::readdir(dir)) {
    const std::string file = entry->d_name;
    if (file.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = std::strtol(file.c_str() + prefix.size(), nullptr, 10);
    const std::string name = "/" + file;
    int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) continue;  // another user's, or already gone
    struct stat st {};
    const bool in_use = probe_lock(fd, 0, 0) != F_UNLCK;
    const bool creator_gone = pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    const bool old = ::fstat(fd, &st) == 0 && std::time(nullptr) - st.st_mtime > 60;
    ::close(fd);
    if (!in_use && (creator_gone || old) && ::shm_unlink(name.c_str()) == 0) {
      DTRAIN_LOG_INFO("shm: removed /dev/shm/", file, " left behind by a crashed process ", pid);
      ++removed;
    }
  }
  ::closedir(dir);
  return removed;
}

}  // namespace dtrain::shm
