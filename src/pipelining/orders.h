#pragma once

// The order in which each schedule runs its forward and backward actions on
// one rank: pure functions of the pipeline's shape, free of torch, so they
// can be checked (every action once, no deadlock, the bubble) without it.
//
// Stages are placed in a loop: stage s on rank s mod p (p ranks), so a
// rank with v stages holds r, r + p, ..., r + (v - 1) p.

#include <string>
#include <vector>

namespace dtrain::pipelining::detail {

enum class ActionKind { FORWARD, BACKWARD };

struct Action {
  ActionKind kind;
  int stage;
  int microbatch;
};

// The schedules, by PyTorch's class names.
enum class ScheduleKind { GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, LOOPED_BFS };
const char* to_string(ScheduleKind kind);  // "ScheduleGPipe", ...
// Whether a rank holds several stages under `kind`.
bool multi_stage(ScheduleKind kind);

inline int rank_of_stage(int stage, int ranks) { return stage % ranks; }

// The actions of `rank` (of `ranks`) for `m` microbatches, holding
// `stages_per_rank` stages (1 for GPipe and 1F1B). The arguments must be
// valid (see check_shape).
std::vector<Action> order_of(ScheduleKind kind, int rank, int ranks, int stages_per_rank, int m);
// "" when the shape suits the schedule, else why not (for an InvalidArgument).
std::string check_shape(ScheduleKind kind, int ranks, int stages_per_rank, int m);

}  // namespace dtrain::pipelining::detail
