#pragma once

// Non-negative decimal numbers read from text that may be hostile (a
// store, a file, a socket): digits only, and a value past the type's range
// is refused rather than thrown as std::out_of_range or wrapped.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace dtrain::detail {

// The value of `text` when it is 1 to digits10 + 1 decimal digits and fits
// in T; nullopt otherwise (empty, a sign, a space, any other byte, or too
// large).
template <typename T>
std::optional<T> parse_digits(std::string_view text) {
  constexpr T kMax = std::numeric_limits<T>::max();
  if (text.empty() || text.size() > static_cast<size_t>(std::numeric_limits<T>::digits10 + 1)) return std::nullopt;
  T v = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const T d = static_cast<T>(c - '0');
    if (v > (kMax - d) / 10) return std::nullopt;
    v = static_cast<T>(v * 10 + d);
  }
  return v;
}

// 1 to 19 digits, up to int64_t's largest: counts, sizes, steps.
inline std::optional<int64_t> parse_decimal(std::string_view text) { return parse_digits<int64_t>(text); }

// 1 to 20 digits, up to uint64_t's largest: identifiers drawn at random.
inline std::optional<uint64_t> parse_decimal_u64(std::string_view text) { return parse_digits<uint64_t>(text); }

}  // namespace dtrain::detail
