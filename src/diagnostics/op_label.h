#pragma once

// A note that the operations a thread issues carry into the flight recorder
// and the timeline while an OpLabel lives on that thread: the batch of a
// batch_isend_irecv, the pipeline stage and microbatch that a send belongs
// to. Labels nest; the innermost one is current.

#include <string>
#include <utility>

namespace dtrain::detail {

class OpLabel {
 public:
  explicit OpLabel(std::string text) : previous_(std::exchange(slot(), std::move(text))) {}
  ~OpLabel() { slot() = std::move(previous_); }
  OpLabel(const OpLabel&) = delete;
  OpLabel& operator=(const OpLabel&) = delete;

  // This thread's current label ("" when none).
  static const std::string& current() { return slot(); }

 private:
  static std::string& slot() {
    thread_local std::string label;
    return label;
  }
  std::string previous_;
};

}  // namespace dtrain::detail
