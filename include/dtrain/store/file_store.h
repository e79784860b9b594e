#pragma once

// Store kept in a file on a filesystem every rank can see (a shared NFS
// directory, or /tmp on one machine). The file is an append-only log of
// records guarded by flock(2); a torn record at the end (a writer killed
// mid-write) is ignored. num_users counts the FileStore objects open on the
// path; the last one to close removes the file, as torch's FileStore does.
//
// Every operation waits for the file's lock at most the store's timeout (a
// wait() at most its own): a process that holds the lock and does not let
// go (stopped with SIGSTOP, hung on a dead NFS server) makes it throw
// TimeoutError "FileStore '<path>': timed out after N ms waiting to lock the
// file: another process holds its lock ...". The destructor waits at most
// kCloseLockWait; then it warns and leaves the file behind.

#include <mutex>
#include <map>

#include "dtrain/store/store.h"

namespace dtrain {

class FileStore : public Store {
 public:
  // The longest the destructor waits for the lock (less when timeout() is).
  static constexpr std::chrono::milliseconds kCloseLockWait{10 * 1000};

  explicit FileStore(std::string path,
                     std::chrono::milliseconds timeout = kDefaultTimeout);
  ~FileStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  using Store::set;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::vector<uint8_t> compare_set(const std::string& key,
                                   const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  void wait(const std::vector<std::string>& keys,
            std::chrono::milliseconds timeout) override;
  using Store::wait;

  const std::string& path() const { return path_; }

 private:
  class Locked;
  // Polls the file until every key exists (then copies the first key's value
  // into *value when value is non-null) or throws TimeoutError.
  void poll_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                std::vector<uint8_t>* value);
  std::string path_;
  std::mutex mutex_;  // one file operation at a time within this process
  // The records read so far from the file generation (device, inode)
  // identified below; cache_offset_ is where the next record starts.
  std::map<std::string, std::vector<uint8_t>> cache_;
  int64_t cache_offset_ = 0;
  uint64_t cache_dev_ = 0;
  uint64_t cache_ino_ = 0;
};

}  // namespace dtrain
