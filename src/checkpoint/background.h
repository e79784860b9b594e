#pragma once

// A background save's outcome, shared by its handles and its lane
// (checkpointer.h), and the background thread's lower priority.

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>


namespace dtrain::checkpoint::background {

// One job's outcome.
struct Outcome {
  mutable std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  bool seen = false;  // a wait() threw its failure to somebody
  bool staged = false;  // the job's input copied (async_save's staging)
  std::exception_ptr error;

  void finish(std::exception_ptr e);
  void mark_staged();
  void wait_staged();  // until staged or done
  bool outcome_ready() const;
  // Blocks until done; its failure, marked as seen when `see`.
  std::exception_ptr outcome(bool see);
  // Blocks until done; its failure if nobody had seen it (now seen).
  std::exception_ptr unseen_failure();
};

// The calling thread's nice value goes 10 up (Linux keeps one per
// thread): where cores are short, training goes first.
void lower_this_threads_priority();

}  // namespace dtrain::checkpoint::background
