#pragma once

// The message of a caught exception, for a record or an error of its own.

#include <exception>
#include <string>

namespace dtrain::detail {

// what() of the exception `error` holds; "unknown error" for one that is not
// a std::exception.
inline std::string error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace dtrain::detail
