#pragma once

// What a TCP store server holds (no sockets here): the keys and their
// values, within the caps DTRAIN_STORE_MAX_KEYS and DTRAIN_STORE_MAX_BYTES.
// Every change is admitted against the caps before anything changes (an
// InvalidArgument naming the variable), so a request that would pass one
// stores nothing. Values are shared with the replies still sending them: a
// change replaces a value a reply holds, never writes into it. One thread
// at a time (the server's).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "store/store_util.h"

namespace dtrain::store_detail {

class KeyValueTable {
 public:
  KeyValueTable(uint64_t max_bytes, uint64_t max_keys) : max_bytes_(max_bytes), max_keys_(max_keys) {}

  void set(const std::string& key, Bytes value);
  // Each pair's key appended to (`append`, where it exists and the result
  // stays within max_value_bytes) or replaced; several pairs are admitted as
  // a whole (each counted as new), so they are stored entirely or not at all.
  void set_all(std::vector<std::pair<std::string, Bytes>> pairs, bool append,
               size_t max_value_bytes);
  // store_util.h's add() and compare_set(); *changed: whether the value did.
  int64_t add(const std::string& key, int64_t delta);
  SharedValue compare_set(const std::string& key, const Bytes& expected, const Bytes& desired,
                          bool* changed);
  // Whether the key was there.
  bool erase(const std::string& key);

  bool has(const std::string& key) const { return data_.count(key) != 0; }
  const SharedValue& at(const std::string& key) const { return data_.at(key); }
  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    return missing_keys(data_, keys);
  }
  int64_t user_keys() const { return count_user_keys(data_); }
  const SharedKeyMap& entries() const { return data_; }

 private:
  size_t entry_bytes(const std::string& key) const;
  void admit(const std::string& key, size_t value_bytes) const;
  void admit_all(size_t keys, uint64_t bytes) const;
  void settle(const std::string& key, size_t bytes_before);

  SharedKeyMap data_;
  uint64_t bytes_ = 0;  // the keys' and values' sizes
  uint64_t max_bytes_;
  uint64_t max_keys_;
};

}  // namespace dtrain::store_detail
