#pragma once

// A call without async_op (the torch.distributed-style functions of
// core/collectives.cpp) waits for its operation on the calling thread right
// after issuing it. BlockingCall says so, for its scope, to the group's
// issue(), which marks the first operation the thread issues
// (Call::blocking); a backend whose untimed waiters run operations
// themselves (SerialExecutor) then need not wake its own thread for it.

namespace dtrain::detail {

inline thread_local bool next_issue_blocking = false;

class BlockingCall {
 public:
  explicit BlockingCall(bool blocking) { next_issue_blocking = blocking; }
  ~BlockingCall() { next_issue_blocking = false; }
  BlockingCall(const BlockingCall&) = delete;
  BlockingCall& operator=(const BlockingCall&) = delete;
};

// Whether the calling thread's next operation is waited for at once; only
// the first operation issued in a BlockingCall's scope is.
inline bool take_blocking_call() {
  const bool blocking = next_issue_blocking;
  next_issue_blocking = false;
  return blocking;
}

}  // namespace dtrain::detail
