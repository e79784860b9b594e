#pragma once

// Tier-2 errors (docs/errors.md): broken invariants inside dtrain. Each
// macro prints both operands, the file and the line, and throws
// dtrain::InternalError. For the caller's mistakes use DTRAIN_CHECK_ARG,
// which throws dtrain::InvalidArgument with the message alone.

#include <sstream>

#include "dtrain/errors.h"

namespace dtrain::detail {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// "0, 1, 3" for any iterable of streamable values.
template <typename Range>
std::string join(const Range& values, const char* sep = ", ") {
  std::ostringstream out;
  bool first = true;
  for (const auto& v : values) {
    if (!first) out << sep;
    out << v;
    first = false;
  }
  return out.str();
}

template <typename A, typename B>
[[noreturn]] void enforce_failed(const char* file, int line, const char* expr,
                                 const A& a, const B& b) {
  throw InternalError(cat("dtrain internal error at ", file, ":", line, ": ",
                          expr, " failed (", a, " vs ", b, ")"));
}

}  // namespace dtrain::detail

#define DTRAIN_ENFORCE_OP(a, b, op)                                      \
  do {                                                                   \
    const auto& dtrain_a_ = (a);                                         \
    const auto& dtrain_b_ = (b);                                         \
    if (!(dtrain_a_ op dtrain_b_))                                       \
      ::dtrain::detail::enforce_failed(__FILE__, __LINE__, #a " " #op " " #b, \
                                       dtrain_a_, dtrain_b_);            \
  } while (0)

#define DTRAIN_ENFORCE_EQ(a, b) DTRAIN_ENFORCE_OP(a, b, ==)
#define DTRAIN_ENFORCE_NE(a, b) DTRAIN_ENFORCE_OP(a, b, !=)
#define DTRAIN_ENFORCE_LT(a, b) DTRAIN_ENFORCE_OP(a, b, <)
#define DTRAIN_ENFORCE_LE(a, b) DTRAIN_ENFORCE_OP(a, b, <=)
#define DTRAIN_ENFORCE(cond)                                             \
  do {                                                                   \
    if (!(cond))                                                         \
      ::dtrain::detail::enforce_failed(__FILE__, __LINE__, #cond, "false", \
                                       "true");                          \
  } while (0)

#define DTRAIN_CHECK_ARG(cond, ...)                                      \
  do {                                                                   \
    if (!(cond)) throw ::dtrain::InvalidArgument(::dtrain::detail::cat(__VA_ARGS__)); \
  } while (0)
