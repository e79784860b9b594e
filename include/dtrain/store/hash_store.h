#pragma once

// In-memory store for ranks that are threads of one process (tests, and
// DataParallel-style single-process groups).

#include <condition_variable>
#include <map>
#include <mutex>

#include "dtrain/store/store.h"

namespace dtrain {

class HashStore : public Store {
 public:
  explicit HashStore(std::chrono::milliseconds timeout = kDefaultTimeout)
      : Store(timeout) {}

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

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<uint8_t>> data_;
};

}  // namespace dtrain
