#include "common/logging.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <mutex>

#include "common/enforce.h"
#include "common/env.h"

namespace dtrain {

DebugLevel parse_debug_level(const std::string& text) {
  std::string upper = text;
  std::transform(upper.begin(), upper.end(), upper.begin(),
                 [](unsigned char c) { return std::toupper(c); });
  if (upper.empty() || upper == "OFF") return DebugLevel::Off;
  if (upper == "INFO") return DebugLevel::Info;
  if (upper == "DETAIL") return DebugLevel::Detail;
  throw InvalidArgument(detail::cat("environment variable ", env::kDebug.name, "='", text,
                                    "' is not one of OFF, INFO, DETAIL"));
}

DebugLevel debug_level() {
  static const DebugLevel level = parse_debug_level(env::get(env::kDebug).value_or("OFF"));
  return level;
}

void log_line(const std::string& message) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  std::fprintf(stderr, "[dtrain] %s\n", message.c_str());
  std::fflush(stderr);
}

void log_warning(const std::string& message) { log_line("warning: " + message); }

}  // namespace dtrain
