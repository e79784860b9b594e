#pragma once

// After a timeout or a transport failure a group is broken: every later call
// fails at once, naming the first error, with the same words on every
// backend (tcp, shm, mpi).

#include <exception>
#include <string>

#include "dtrain/errors.h"

namespace dtrain {

inline std::exception_ptr broken_group_error(const std::string& call, std::exception_ptr first) {
  std::string why = "an earlier timeout or error";
  try {
    if (first) std::rethrow_exception(first);
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
  }
  return std::make_exception_ptr(NetworkError(call + " cannot run: the group is broken by an earlier error (" +
                                              why + "); destroy it and create a new one"));
}

}  // namespace dtrain
