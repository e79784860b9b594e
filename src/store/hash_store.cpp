#include "dtrain/store/hash_store.h"

#include "store/store_util.h"

// One map under one mutex. Blocking calls wait on a condition variable that
// every insertion notifies, so a waiter wakes as soon as its key appears and
// never polls.

namespace dtrain {

using namespace store_detail;

void HashStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    data_[key] = value;
  }
  changed_.notify_all();
}

std::vector<uint8_t> HashStore::get(const std::string& key) {
  const auto timeout = this->timeout();
  std::unique_lock<std::mutex> lock(mutex_);
  const bool found = changed_.wait_for(lock, timeout, [&] { return data_.count(key) > 0; });
  if (!found) throw TimeoutError(timeout_message("HashStore", timeout, {key}));
  return data_.at(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t sum;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    sum = apply_add(data_, key, delta);
  }
  changed_.notify_all();
  return sum;
}

std::vector<uint8_t> HashStore::compare_set(const std::string& key,
                                            const std::vector<uint8_t>& expected,
                                            const std::vector<uint8_t>& desired) {
  bool changed = false;
  std::vector<uint8_t> now;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    now = apply_compare_set(data_, key, expected, desired, &changed);
  }
  if (changed) changed_.notify_all();
  return now;
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  return missing_keys(data_, keys).empty();
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.erase(key) > 0;
}

int64_t HashStore::num_keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  return count_user_keys(data_);
}

void HashStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool found = changed_.wait_for(
      lock, timeout, [&] { return missing_keys(data_, keys).empty(); });
  if (!found) throw TimeoutError(timeout_message("HashStore", timeout, missing_keys(data_, keys)));
}

}  // namespace dtrain
