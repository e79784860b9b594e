#pragma once

// dtrain's error policy (see docs/errors.md).
//
// Tier 1 — things that can happen at run time and that a program may catch:
// every one derives from dtrain::Error, so `catch (const dtrain::Error&)`
// catches them all. The message always names what was wrong and where
// (the variable and its value, the host:port, the rank, the key).
//
// Tier 2 — broken internal invariants (a bug in dtrain) are reported by the
// DTRAIN_ENFORCE macros in src/common/enforce.h; they throw InternalError
// with both operands, file and line.

#include <stdexcept>
#include <string>

namespace dtrain {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Bad input from the caller: a bad argument, environment variable or
// init_method, a root out of range, mismatched tensors. Raised before any
// communication starts.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A blocking call did not finish within its timeout (a silent or stopped
// peer, a store key never set, ranks that never joined).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// The transport failed: connection refused or reset, a peer that died,
// a port already in use, a protocol violation on a socket.
class NetworkError : public Error {
 public:
  using Error::Error;
};

// The requested backend is not compiled into this build (e.g. nccl without
// CUDA) or is unknown.
class BackendUnavailable : public Error {
 public:
  using Error::Error;
};

// DTRAIN_DEBUG=DETAIL found ranks calling different collectives (or the same
// collective on different shapes or dtypes) at the same point.
class CollectiveMismatch : public Error {
 public:
  using Error::Error;
};

// A broken invariant inside dtrain; please report it.
class InternalError : public Error {
 public:
  using Error::Error;
};

}  // namespace dtrain
