#include "store/key_value_table.h"

#include "common/enforce.h"

namespace dtrain::store_detail {

size_t KeyValueTable::entry_bytes(const std::string& key) const {
  auto it = data_.find(key);
  return it == data_.end() ? 0 : key.size() + it->second->size();
}

void KeyValueTable::admit(const std::string& key, size_t value_bytes) const {
  const size_t before = entry_bytes(key);
  DTRAIN_CHECK_ARG(before > 0 || data_.size() < max_keys_, "the TCP store is full: it holds ",
                   data_.size(), " keys, the limit set by DTRAIN_STORE_MAX_KEYS; not storing ",
                   quote(key));
  const uint64_t after = bytes_ - before + key.size() + value_bytes;
  DTRAIN_CHECK_ARG(after <= max_bytes_, "the TCP store is full: storing ", quote(key), " (",
                   value_bytes, " bytes) would make its keys and values ", after,
                   " bytes, over the limit of ", max_bytes_, " set by DTRAIN_STORE_MAX_BYTES");
}

void KeyValueTable::admit_all(size_t keys, uint64_t bytes) const {
  DTRAIN_CHECK_ARG(data_.size() + keys <= max_keys_ && bytes_ + bytes <= max_bytes_,
                   "the TCP store is full: storing ", keys, " keys (", bytes,
                   " bytes) would pass the limits set by DTRAIN_STORE_MAX_KEYS (", max_keys_,
                   ") or DTRAIN_STORE_MAX_BYTES (", max_bytes_, ")");
}

void KeyValueTable::settle(const std::string& key, size_t bytes_before) {
  bytes_ = bytes_ - bytes_before + entry_bytes(key);
}

void KeyValueTable::set(const std::string& key, Bytes value) {
  admit(key, value.size());
  const size_t before = entry_bytes(key);
  data_[key] = std::make_shared<Bytes>(std::move(value));
  settle(key, before);
}

void KeyValueTable::set_all(std::vector<std::pair<std::string, Bytes>> pairs, bool append,
                            size_t max_value_bytes) {
  uint64_t total = 0;
  for (const auto& [key, value] : pairs) total += key.size() + value.size();
  if (pairs.size() > 1) admit_all(pairs.size(), total);
  for (auto& [key, value] : pairs) {
    const size_t before = entry_bytes(key);
    const bool grows = append && before > 0 && before - key.size() + value.size() <= max_value_bytes;
    if (pairs.size() == 1) admit(key, grows ? before - key.size() + value.size() : value.size());
    auto& slot = data_[key];
    if (grows && slot.use_count() > 1)  // unsent replies hold the old value
      slot = std::make_shared<Bytes>(*slot);
    if (grows)
      slot->insert(slot->end(), value.begin(), value.end());
    else
      slot = std::make_shared<Bytes>(std::move(value));
    settle(key, before);
  }
}

int64_t KeyValueTable::add(const std::string& key, int64_t delta) {
  admit(key, 20);  // the longest int64 in decimal
  const size_t before = entry_bytes(key);
  const int64_t sum = apply_add(data_, key, delta);
  settle(key, before);
  return sum;
}

SharedValue KeyValueTable::compare_set(const std::string& key, const Bytes& expected,
                                       const Bytes& desired, bool* changed) {
  admit(key, desired.size());
  const size_t before = entry_bytes(key);
  auto now = apply_compare_set(data_, key, expected, desired, changed);
  settle(key, before);
  return now;
}

bool KeyValueTable::erase(const std::string& key) {
  bytes_ -= entry_bytes(key);
  return data_.erase(key) != 0;
}

}  // namespace dtrain::store_detail
