#pragma once

// Context added to a dtrain error on its way up, its type kept (callers
// catch TimeoutError apart from NetworkError).

#include <string>

#include "dtrain/errors.h"

namespace dtrain::detail {

// Rethrows the exception being handled (a dtrain::Error) with `context` in
// front; call it from a catch block.
[[noreturn]] inline void rethrow_with(const std::string& context) {
  try {
    throw;
  } catch (const TimeoutError& e) {
    throw TimeoutError(context + e.what());
  } catch (const NetworkError& e) {
    throw NetworkError(context + e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(context + e.what());
  } catch (const CollectiveMismatch& e) {
    throw CollectiveMismatch(context + e.what());
  } catch (const BackendUnavailable& e) {
    throw BackendUnavailable(context + e.what());
  } catch (const InternalError& e) {
    throw InternalError(context + e.what());
  } catch (const Error& e) {
    throw Error(context + e.what());
  }
}

}  // namespace dtrain::detail
