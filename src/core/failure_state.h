#pragma once

// A group's broken state and its failure policy, one class for every
// backend (the engine's tcp/shm/auto groups, mpi, nccl, and SerialExecutor).
//
// The policy: an error that every rank raises at the same step of the same
// operation leaves the ranks in step, so it fails that operation only; any
// other error (a timeout, a dead peer, a transport failure) breaks the
// group. From then on every operation fails at once, naming the first
// error, with the same words on every backend (broken_group_error). Which
// errors a backend raises in step is its to say (`in_step`); by default an
// InvalidArgument or a CollectiveMismatch.

#include <exception>
#include <functional>
#include <mutex>
#include <string>

#include "dtrain/errors.h"
#include "dtrain/work.h"

namespace dtrain {

inline std::exception_ptr broken_group_error(const std::string& call, std::exception_ptr first) {
  std::string why = "an earlier timeout or error";
  try {
    if (first) std::rethrow_exception(first);
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
  }
  return std::make_exception_ptr(NetworkError(
      call + " cannot run: the group is broken by an earlier error (" + why +
      "); destroy it and create a new one"));
}

class FailureState {
 public:
  using InStep = bool (*)(const std::exception_ptr&);

  static bool argument_or_mismatch(const std::exception_ptr& error) {
    try {
      std::rethrow_exception(error);
    } catch (const InvalidArgument&) {
      return true;
    } catch (const CollectiveMismatch&) {
      return true;
    } catch (...) {
      return false;
    }
  }

  explicit FailureState(InStep in_step = argument_or_mismatch) : in_step_(in_step) {}
  FailureState(const FailureState&) = delete;
  FailureState& operator=(const FailureState&) = delete;

  // A state kept elsewhere that breaks the group too (a transport's own,
  // set by its I/O thread when a peer dies), asked first; and what breaking
  // the group does beyond recording it (failing that transport, so that
  // peers stop waiting). Set both before the group runs anything.
  void watch(std::function<std::exception_ptr()> source) { source_ = std::move(source); }
  void on_break(std::function<void(const std::exception_ptr&)> hook) {
    on_break_ = std::move(hook);
  }

  // The error that broke the group; null while none has.
  std::exception_ptr error() const {
    if (source_)
      if (auto e = source_()) return e;
    std::lock_guard<std::mutex> lock(mutex_);
    return first_;
  }

  // Applies the policy to `error`; returns whether the group is broken by it.
  bool fail(const std::exception_ptr& error) {
    if (in_step_(error)) return false;
    break_with(error);
    return true;
  }

  // Breaks the group whatever `error` is (the first error is kept).
  void break_with(const std::exception_ptr& error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_) first_ = error;
    }
    if (on_break_) on_break_(error);
  }

  // When the group is broken: finishes `work` with the error that says so,
  // and returns true.
  bool refuse(Work& work) const {
    auto first = error();
    if (!first) return false;
    work.finish(broken_group_error(work.description(), first));
    return true;
  }

  // Refuses `work`, or completes it with `body` (below).
  void run(Work& work, const std::function<void()>& body) {
    if (!refuse(work)) complete(work, body);
  }

  // Runs `body`, even on a broken group (an operation already posted must
  // be seen through), and finishes `work` with its outcome under the policy.
  // The group is broken before the failed work is finished, so a caller
  // woken by that failure already sees error().
  void complete(Work& work, const std::function<void()>& body) {
    std::exception_ptr failure;
    try {
      body();
    } catch (...) {
      failure = std::current_exception();
      fail(failure);
    }
    work.finish(failure);
  }

 private:
  InStep in_step_;
  std::function<std::exception_ptr()> source_;
  std::function<void(const std::exception_ptr&)> on_break_;
  mutable std::mutex mutex_;
  std::exception_ptr first_;
};

}  // namespace dtrain
