#pragma once

// Semantics shared by every store implementation (in-memory, file, and the
// TCP store's server), so that add(), compare_set(), num_keys() and the
// timeout messages behave identically whichever store a program picks.

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/enforce.h"

namespace dtrain::store_detail {

using Bytes = std::vector<uint8_t>;
using KeyMap = std::map<std::string, Bytes>;

// Keys a store keeps for its own bookkeeping (worker and user counters)
// start with this prefix; num_keys() does not count them.
inline constexpr const char* kInternalPrefix = "__dtrain_";

inline bool is_internal(const std::string& key) {
  return key.compare(0, std::char_traits<char>::length(kInternalPrefix), kInternalPrefix) == 0;
}

// Values as the in-memory and file stores hold them (Bytes), or as the TCP
// store's server does (shared with the replies that send them).
using SharedValue = std::shared_ptr<Bytes>;
using SharedKeyMap = std::map<std::string, SharedValue>;
inline const Bytes& value_bytes(const Bytes& v) { return v; }
inline const Bytes& value_bytes(const SharedValue& v) { return *v; }
template <typename Value>
Value make_value(Bytes b);
template <>
inline Bytes make_value<Bytes>(Bytes b) { return b; }
template <>
inline SharedValue make_value<SharedValue>(Bytes b) { return std::make_shared<Bytes>(std::move(b)); }

template <typename Map>
int64_t count_user_keys(const Map& map) {
  int64_t n = 0;
  for (const auto& kv : map) n += is_internal(kv.first) ? 0 : 1;
  return n;
}

// 'key' for messages; very long keys are shortened so errors stay readable.
inline std::string quote(const std::string& key) {
  if (key.size() <= 200) return "'" + key + "'";
  return detail::cat("'", key.substr(0, 200), "...' (", key.size(), " bytes)");
}

inline std::string quote_all(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : ", ") + quote(k);
  return out;
}

// "<where>: timed out after 500 ms waiting for key 'foo'" (or "keys 'a', 'b'",
// listing the keys still missing).
inline std::string timeout_message(const std::string& where, std::chrono::milliseconds timeout,
                                   const std::vector<std::string>& missing) {
  return detail::cat(where, ": timed out after ", timeout.count(), " ms waiting for ",
                     missing.size() == 1 ? "key " : "keys ", quote_all(missing));
}

template <typename Map>
std::vector<std::string> missing_keys(const Map& map, const std::vector<std::string>& keys) {
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (map.count(k) == 0) missing.push_back(k);
  return missing;
}

// add(): a missing key counts as 0; the sum is stored as a decimal string.
// A value that is not a decimal integer, or a sum that overflows, is the
// caller's mistake (InvalidArgument naming the key).
template <typename Map>
int64_t apply_add(Map& map, const std::string& key, int64_t delta) {
  int64_t current = 0;
  auto it = map.find(key);
  if (it != map.end()) {
    const Bytes& stored = value_bytes(it->second);
    const std::string text(stored.begin(), stored.end());
    char* end = nullptr;
    errno = 0;
    const long long v = text.empty() ? 0 : std::strtoll(text.c_str(), &end, 10);
    DTRAIN_CHECK_ARG(!text.empty() && errno == 0 && end == text.c_str() + text.size(),
                     "add(", quote(key), ", ", delta, "): the stored value '",
                     text.substr(0, 64), "' is not a decimal integer");
    current = v;
  }
  int64_t sum = 0;
  DTRAIN_CHECK_ARG(!__builtin_add_overflow(current, delta, &sum), "add(", quote(key), ", ",
                   delta, "): the sum overflows int64 (stored value ", current, ")");
  const std::string text = std::to_string(sum);
  map[key] = make_value<typename Map::mapped_type>(Bytes(text.begin(), text.end()));
  return sum;
}

// compare_set() as torch.distributed's stores do it: the key becomes
// `desired` when it holds `expected`, or when it is missing and `expected`
// is empty. Returns the value now stored; for a missing key with a non-empty
// `expected` nothing is stored and `expected` is returned (torch's rule).
// *changed tells the caller whether to persist/notify.
template <typename Map>
typename Map::mapped_type apply_compare_set(Map& map, const std::string& key, const Bytes& expected,
                                            const Bytes& desired, bool* changed) {
  using Value = typename Map::mapped_type;
  *changed = false;
  auto it = map.find(key);
  if (it == map.end()) {
    if (!expected.empty()) return make_value<Value>(expected);
    *changed = true;
    return map[key] = make_value<Value>(desired);
  }
  if (value_bytes(it->second) == expected) {
    it->second = make_value<Value>(desired);
    *changed = true;
  }
  return it->second;
}

}  // namespace dtrain::store_detail
