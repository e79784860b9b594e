#pragma once

// Writing JSON by hand (flight recorder dumps, timeline events): a string's
// characters escaped for use between double quotes.

#include <cstdio>
#include <string>

namespace dtrain::detail {

inline std::string json_escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

}  // namespace dtrain::detail
