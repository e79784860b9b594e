#pragma once

// Non-negative decimal numbers read from text that may be hostile (a
// store, a file, a socket): digits only, and a value past int64_t's range
// is refused rather than thrown as std::out_of_range or wrapped.

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace dtrain::detail {

// The value of `text` when it is 1 to 19 decimal digits and fits in
// int64_t; nullopt otherwise (empty, a sign, a space, any other byte, or
// too large).
inline std::optional<int64_t> parse_decimal(std::string_view text) {
  if (text.empty() || text.size() > 19) return std::nullopt;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t v = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const int d = c - '0';
    if (v > (kMax - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  return v;
}

}  // namespace dtrain::detail
