#include "dtrain/store/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/logging.h"
#include "store/store_util.h"

// File layout: a sequence of records, each
//   u8 type ('S' set, 'D' delete) | u32 key length | u32 value length | key | value
// with little-endian lengths. Replaying the records in order gives the
// store's contents; add() and compare_set() read the log under an exclusive
// flock(2), compute the new value and append it as a plain 'S' record, so the
// log never needs more than two record types.
//
// Every operation opens the file, takes the lock, reads only the records
// appended since this object last looked (cache_offset_), and closes the
// file again. Reopening per operation is what makes NFS's close-to-open
// consistency show other machines' writes, and it lets the last user remove
// the file without leaving anyone holding a stale descriptor for long.
//
// A writer killed in the middle of a record leaves a torn tail. Readers stop
// at the last complete record; the next writer truncates the torn bytes
// before appending, so they never merge with a later record.

namespace dtrain {

using namespace store_detail;

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kRecordHeader = 9;
const std::string kUsersKey = std::string(kInternalPrefix) + "file_store_users";

uint32_t read_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

void put_u32(std::vector<uint8_t>* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

std::string where(const std::string& path) { return "FileStore '" + path + "'"; }

}  // namespace

// Holds the open file and its flock for one operation; refreshes the
// store's cache from the file on construction. The caller holds mutex_.
class FileStore::Locked {
 public:
  // Waits for the flock until the deadline (TimeoutError naming the file:
  // flock(2) itself would wait for ever on a stopped or hung process);
  // wait_ms is how long that is, for the message.
  Locked(FileStore& store, bool exclusive, Clock::time_point deadline, int64_t wait_ms)
      : s_(store) {
    open_and_lock(exclusive, deadline, wait_ms);
  }
  // Within the store's timeout.
  Locked(FileStore& store, bool exclusive)
      : Locked(store, exclusive, Clock::now() + store.timeout(), store.timeout().count()) {}
  ~Locked() { ::close(fd_); }  // closing releases the flock
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;

  // Appends the cache's current value of key (or a deletion when the cache
  // no longer has it). Requires the exclusive lock.
  void persist(const std::string& key) {
    if (torn_) {
      if (::ftruncate(fd_, s_.cache_offset_) != 0) fail("ftruncate");
      torn_ = false;
    }
    auto it = s_.cache_.find(key);
    std::vector<uint8_t> rec;
    rec.push_back(it == s_.cache_.end() ? 'D' : 'S');
    put_u32(&rec, static_cast<uint32_t>(key.size()));
    put_u32(&rec, it == s_.cache_.end() ? 0 : static_cast<uint32_t>(it->second.size()));
    rec.insert(rec.end(), key.begin(), key.end());
    if (it != s_.cache_.end()) rec.insert(rec.end(), it->second.begin(), it->second.end());
    size_t done = 0;
    while (done < rec.size()) {
      const ssize_t n = ::pwrite(fd_, rec.data() + done, rec.size() - done,
                                 s_.cache_offset_ + static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("write");
      done += static_cast<size_t>(n);
    }
    s_.cache_offset_ += static_cast<int64_t>(rec.size());
  }

  void remove_file() { ::unlink(s_.path_.c_str()); }

 private:
  [[noreturn]] void fail(const char* what) {
    // The file system is this store's transport; its failures are
    // reported like a network failure.
    throw NetworkError(detail::cat(where(s_.path_), ": ", what, " failed: ", std::strerror(errno)));
  }

  void open_and_lock(bool exclusive, Clock::time_point deadline, int64_t wait_ms) {
    // The last user of a file generation unlinks it while holding the lock;
    // whoever was queued on that lock then finds the path gone or pointing
    // to a new file, and must reopen rather than write to the dead inode.
    for (;;) {
      // Not through a symbolic link, created private, and only a regular
      // file this user owns: anyone who can write the file can change the
      // job's keys, so a file planted by someone else is refused.
      fd_ = ::open(s_.path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
      if (fd_ < 0) {
        const int err = errno;
        throw InvalidArgument(detail::cat(
            where(s_.path_), ": cannot open the file: ", std::strerror(err),
            err == ENOENT  ? " (does its directory exist?)"
            : err == ELOOP ? " (it is a symbolic link; a FileStore opens only a regular file "
                             "of its own)"
                           : ""));
      }
      try {
        check_owned(fd_);
        lock(exclusive, deadline, wait_ms);
        struct stat opened {}, named {};
        if (::fstat(fd_, &opened) != 0) fail("fstat");
        if (::stat(s_.path_.c_str(), &named) == 0 && named.st_dev == opened.st_dev &&
            named.st_ino == opened.st_ino) {
          refresh(opened);
          return;
        }
      } catch (...) {
        ::close(fd_);  // no destructor runs for a constructor that throws
        throw;
      }
      ::close(fd_);
    }
  }

  void check_owned(int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail("fstat");
    if (!S_ISREG(st.st_mode))
      throw InvalidArgument(detail::cat(where(s_.path_), ": is not a regular file"));
    if (st.st_uid != ::geteuid())
      throw InvalidArgument(detail::cat(
          where(s_.path_), ": is owned by uid ", st.st_uid, ", not by this process's user (uid ",
          ::geteuid(), "); a FileStore uses only a file of its own user, as another user could "
          "read and change the job's keys"));
  }

  // flock(2) has no timeout: try without blocking, back off from 100 us to
  // 10 ms between tries (the lock is normally held for microseconds).
  void lock(bool exclusive, Clock::time_point deadline, int64_t wait_ms) {
    std::chrono::microseconds backoff(100);
    for (;;) {
      if (::flock(fd_, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) == 0) return;
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) fail("flock");
      const auto left = deadline - Clock::now();
      if (left <= Clock::duration::zero())
        throw TimeoutError(detail::cat(where(s_.path_), ": timed out after ", wait_ms,
                                       " ms waiting to lock the file: another process holds "
                                       "its lock (is a rank stopped or stuck?)"));
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
      backoff = std::min(backoff * 2, std::chrono::microseconds(10000));
    }
  }

  // Replays the records appended since the last look.
  void refresh(const struct stat& st) {
    if (uint64_t(st.st_dev) != s_.cache_dev_ || uint64_t(st.st_ino) != s_.cache_ino_ ||
        st.st_size < s_.cache_offset_) {
      // A new file generation (the old one was removed by its last user).
      s_.cache_.clear();
      s_.cache_offset_ = 0;
      s_.cache_dev_ = st.st_dev;
      s_.cache_ino_ = st.st_ino;
    }
    const int64_t size = st.st_size;
    std::vector<uint8_t> buf(static_cast<size_t>(size - s_.cache_offset_));
    size_t got = 0;
    while (got < buf.size()) {
      const ssize_t n = ::pread(fd_, buf.data() + got, buf.size() - got,
                                s_.cache_offset_ + static_cast<off_t>(got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("read");
      if (n == 0) break;  // shrank under us (cannot happen under the lock)
      got += static_cast<size_t>(n);
    }
    size_t pos = 0;
    while (got - pos >= kRecordHeader) {
      const uint8_t* p = buf.data() + pos;
      const uint64_t klen = read_u32(p + 1), vlen = read_u32(p + 5);
      if (p[0] != 'S' && p[0] != 'D')
        throw NetworkError(detail::cat(where(s_.path_), ": corrupt record at byte ",
                                       s_.cache_offset_ + int64_t(pos),
                                       " (was the file written by something else?)"));
      if (got - pos - kRecordHeader < klen + vlen) break;  // torn tail
      std::string key(reinterpret_cast<const char*>(p + kRecordHeader), klen);
      if (p[0] == 'S') {
        const uint8_t* v = p + kRecordHeader + klen;
        s_.cache_[key].assign(v, v + vlen);
      } else {
        s_.cache_.erase(key);
      }
      pos += kRecordHeader + klen + vlen;
    }
    s_.cache_offset_ += static_cast<int64_t>(pos);
    torn_ = s_.cache_offset_ != size;
  }

  FileStore& s_;
  int fd_ = -1;
  bool torn_ = false;
};

FileStore::FileStore(std::string path, std::chrono::milliseconds timeout)
    : Store(timeout), path_(std::move(path)) {
  DTRAIN_CHECK_ARG(!path_.empty(), "FileStore: the path is empty");
  std::lock_guard<std::mutex> guard(mutex_);
  Locked file(*this, true);
  apply_add(cache_, kUsersKey, 1);
  file.persist(kUsersKey);
}

FileStore::~FileStore() {
  // A stopped process holding the lock must not hang our exit: wait as long
  // as an operation would, but at most kCloseLockWait, then leave the file
  // (with this user still counted) and say so.
  const auto wait = std::min(timeout(), kCloseLockWait);
  try {
    std::lock_guard<std::mutex> guard(mutex_);
    Locked file(*this, true, Clock::now() + wait, wait.count());
    if (apply_add(cache_, kUsersKey, -1) <= 0) {
      file.remove_file();
    } else {
      file.persist(kUsersKey);
    }
  } catch (const TimeoutError& e) {
    log_warning(detail::cat(e.what(), "; closing without updating the file, which stays behind"));
  } catch (const std::exception&) {
    // The file may already be gone (a removed directory); nothing to do.
  }
}

void FileStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::lock_guard<std::mutex> guard(mutex_);
  Locked file(*this, true);
  cache_[key] = value;
  file.persist(key);
}

std::vector<uint8_t> FileStore::get(const std::string& key) {
  std::vector<uint8_t> value;
  poll_for({key}, timeout(), &value);
  return value;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> guard(mutex_);
  Locked file(*this, true);
  const int64_t sum = apply_add(cache_, key, delta);
  file.persist(key);
  return sum;
}

std::vector<uint8_t> FileStore::compare_set(const std::string& key,
                                            const std::vector<uint8_t>& expected,
                                            const std::vector<uint8_t>& desired) {
  std::lock_guard<std::mutex> guard(mutex_);
  Locked file(*this, true);
  bool changed = false;
  auto now = apply_compare_set(cache_, key, expected, desired, &changed);
  if (changed) file.persist(key);
  return now;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> guard(mutex_);
  Locked file(*this, false);
  return missing_keys(cache_, keys).empty();
}

bool FileStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> guard(mutex_);
  Locked file(*this, true);
  if (cache_.erase(key) == 0) return false;
  file.persist(key);
  return true;
}

int64_t FileStore::num_keys() {
  std::lock_guard<std::mutex> guard(mutex_);
  Locked file(*this, false);
  return count_user_keys(cache_);
}

void FileStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  poll_for(keys, timeout, nullptr);
}

// Other processes give no notification when they append, so waiting means
// re-reading the file: first after 1 ms, backing off to 10 ms, which keeps
// rendezvous latency low without hammering a shared file system.
void FileStore::poll_for(const std::vector<std::string>& keys,
                         std::chrono::milliseconds timeout, std::vector<uint8_t>* value) {
  const auto deadline = Clock::now() + timeout;
  std::chrono::milliseconds backoff(1);
  for (;;) {
    std::vector<std::string> missing;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      Locked file(*this, false, deadline, timeout.count());
      missing = missing_keys(cache_, keys);
      if (missing.empty()) {
        if (value != nullptr) *value = cache_.at(keys.front());
        return;
      }
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero())
      throw TimeoutError(timeout_message(where(path_), timeout, missing));
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(10));
  }
}

}  // namespace dtrain
