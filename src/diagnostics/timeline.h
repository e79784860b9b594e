#pragma once

// The writer behind DTRAIN_TIMELINE (include/dtrain/timeline.h): complete
// events ("ph": "X") appended one per line to PATH.rank-R.json in the
// trace event array format (no closing bracket needed, so a crashed rank's
// file still loads). Times are wall-clock microseconds, so the ranks of one
// machine line up. Thread-safe.

#include <chrono>
#include <string>

namespace dtrain::detail::timeline {

using Clock = std::chrono::steady_clock;

// Tracks of a rank (Chrome's thread ids).
constexpr int kStepTrack = 1;          // forward, backward, user spans
constexpr int kBucketTrack = 100;      // + bucket index: one per DDP bucket
constexpr int kCollectiveTrack = 1000; // + group id: one per process group
constexpr int kPipelineTrack = 100000; // + stage index: one per pipeline stage

// The process's global rank, which names its file (init_process_group sets
// it; a process that records before, or without, one is named by its pid).
void set_rank(int rank);
// Whether DTRAIN_TIMELINE is set (read once).
bool enabled();
// Appends one span; `args` is the body of a JSON object ("" for none).
void span(const std::string& name, int track, Clock::time_point begin, Clock::time_point end,
          const std::string& args = "");
// Names a track (a metadata event), once per track.
void name_track(int track, const std::string& name);
// Writes what is buffered to the file (end of a DDP step, and at exit).
void flush();

}  // namespace dtrain::detail::timeline
