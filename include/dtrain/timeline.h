#pragma once

// The step timeline. With DTRAIN_TIMELINE=PATH each rank writes a
// Chrome-trace / Perfetto event file, PATH.rank-R.json: DDP's forward and
// backward, each bucket's communication (launch to done, one track per
// bucket), each collective of each group, and the spans you add:
//
//   { dtrain::TimelineSpan span("optimizer.step"); opt.step(); }
//
// dtrain-run merges its workers' files into PATH, one track group per rank
// (load it in ui.perfetto.dev or chrome://tracing). Without the variable a
// span costs one branch. See docs/debugging.md.

#include <chrono>

namespace dtrain {

// Marks [construction, destruction) on this rank's "step" track, named
// `name` (a string literal: it must outlive the process's timeline).
class TimelineSpan {
 public:
  explicit TimelineSpan(const char* name);
  ~TimelineSpan();
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  const char* name_;
  std::chrono::steady_clock::time_point begin_;
};

}  // namespace dtrain
