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

// Runs `step`, turning what it throws into its error text ("" when it
// succeeds): a rank's outcome for dtrain::fail_together.
template <typename Step>
std::string error_of(Step&& step) {
  try {
    step();
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace dtrain::detail
