#pragma once

// The order in which each schedule runs its forward and backward actions on
// one rank: pure functions of the pipeline's shape, free of torch, so they
// can be checked (every action once, no deadlock, the bubble) without it.
//
// Stages are placed in a loop: stage s on rank s mod p (p ranks), so a
// rank with v stages holds r, r + p, ..., r + (v - 1) p; or, for the V
// schedule, down and back up: rank r holds stages r and 2p - 1 - r.

#include <string>
#include <vector>

namespace dtrain::pipelining::detail {

// BACKWARD is a whole backward; the zero-bubble schedule splits it into
// INPUT_GRAD (the gradient the previous stage waits for) and WEIGHT_GRAD
// (the parameters' gradients, which nobody waits for).
enum class ActionKind { FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD };

struct Action {
  ActionKind kind;
  int stage;
  int microbatch;
};

// The schedules, by PyTorch's class names.
enum class ScheduleKind { GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, LOOPED_BFS, ZBV_ZERO_BUBBLE };
const char* to_string(ScheduleKind kind);  // "ScheduleGPipe", ...
// Whether a rank holds several stages under `kind`.
bool multi_stage(ScheduleKind kind);

// The rank of `ranks` that holds `stage` under `kind`.
inline int rank_of_stage(ScheduleKind kind, int stage, int ranks) {
  if (kind == ScheduleKind::ZBV_ZERO_BUBBLE) return stage < ranks ? stage : 2 * ranks - 1 - stage;
  return stage % ranks;
}
// How the placement reads in an error message.
const char* placement_text(ScheduleKind kind);

// The actions of `rank` (of `ranks`) for `m` microbatches, holding
// `stages_per_rank` stages (1 for GPipe and 1F1B). The arguments must be
// valid (see check_shape).
std::vector<Action> order_of(ScheduleKind kind, int rank, int ranks, int stages_per_rank, int m);
// "" when the shape suits the schedule, else why not (for an InvalidArgument).
std::string check_shape(ScheduleKind kind, int ranks, int stages_per_rank, int m);

}  // namespace dtrain::pipelining::detail
