#pragma once

// Levels follow DTRAIN_DEBUG: OFF < INFO < DETAIL. Messages go to stderr,
// one line each, prefixed with "[dtrain]".

#include <string>

#include "common/enforce.h"  // detail::cat, which the macros below use

namespace dtrain {

enum class DebugLevel { Off = 0, Info = 1, Detail = 2 };

// Parsed once from DTRAIN_DEBUG (cached); a bad value throws InvalidArgument.
DebugLevel debug_level();
DebugLevel parse_debug_level(const std::string& text);

void log_line(const std::string& message);
// Something the user should fix (e.g. a missing set_epoch): printed at every
// DTRAIN_DEBUG level, OFF included, as "[dtrain] warning: <message>".
void log_warning(const std::string& message);

}  // namespace dtrain

#define DTRAIN_LOG_INFO(...)                                              \
  do {                                                                    \
    if (::dtrain::debug_level() >= ::dtrain::DebugLevel::Info)            \
      ::dtrain::log_line(::dtrain::detail::cat(__VA_ARGS__));             \
  } while (0)
