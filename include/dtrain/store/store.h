#pragma once

// The key-value store that ranks rendezvous through.
//
// Contract for every implementation:
//  - All calls are thread safe.
//  - get() blocks until the key exists or timeout() passes (TimeoutError
//    naming the key); wait() does the same for a list of keys with an
//    explicit timeout.
//  - add() treats a missing key as 0 and stores the sum as a decimal string,
//    so get() on a counter returns e.g. "3".
//  - compare_set() follows torch.distributed's Store.compare_set: when the
//    current value equals `expected` (or the key is missing and `expected` is
//    empty) the key becomes `desired`; it returns the value now stored.
//    A missing key with a non-empty `expected` stays missing and `expected`
//    is returned, as torch's stores do.
//  - Keys starting with "__dtrain_" are reserved for the stores' own
//    bookkeeping (user and worker counters); num_keys() does not count them.
//  - Failures are dtrain::TimeoutError / NetworkError / InvalidArgument.
// No header here includes torch: the store is usable without libtorch.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dtrain {

class Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{300 * 1000};

  explicit Store(std::chrono::milliseconds timeout = kDefaultTimeout)
      : timeout_(timeout) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual std::vector<uint8_t> compare_set(const std::string& key,
                                           const std::vector<uint8_t>& expected,
                                           const std::vector<uint8_t>& desired) = 0;
  // True when every key exists; never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // True when the key existed.
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;
  virtual void wait(const std::vector<std::string>& keys,
                    std::chrono::milliseconds timeout) = 0;

  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

  // String conveniences.
  void set(const std::string& key, const std::string& value) {
    set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get_string(const std::string& key) {
    auto v = get(key);
    return std::string(v.begin(), v.end());
  }

  std::chrono::milliseconds timeout() const { return timeout_; }
  virtual void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 protected:
  std::chrono::milliseconds timeout_;
};

}  // namespace dtrain
