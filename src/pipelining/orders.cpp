#include "pipelining/orders.h"

#include <algorithm>

#include "common/enforce.h"

namespace dtrain::pipelining::detail {
namespace {

Action forward(int stage, int mb) { return Action{ActionKind::FORWARD, stage, mb}; }
Action backward(int stage, int mb) { return Action{ActionKind::BACKWARD, stage, mb}; }

// All forwards, then all backwards (each in microbatch order).
std::vector<Action> gpipe(int stage, int m) {
  std::vector<Action> out;
  for (int i = 0; i < m; ++i) out.push_back(forward(stage, i));
  for (int i = 0; i < m; ++i) out.push_back(backward(stage, i));
  return out;
}

// Warm up with one forward per later stage, then alternate one forward and
// one backward, then drain the backwards: stage s holds at most p - s
// microbatches' activations.
std::vector<Action> one_f_one_b(int stage, int stages, int m) {
  std::vector<Action> out;
  const int warmup = std::min(m, stages - stage - 1);
  for (int i = 0; i < warmup; ++i) out.push_back(forward(stage, i));
  int next_forward = warmup;
  for (int i = 0; i < m; ++i) {
    if (next_forward < m) out.push_back(forward(stage, next_forward++));
    out.push_back(backward(stage, i));
  }
  return out;
}

// Megatron-LM's interleaved 1F1B: microbatches go through the rank's v
// stages in rounds of p; the k-th forward is for local stage (k mod pv) / p
// and microbatch (k / pv) p + k mod p; backwards visit the local stages in
// reverse. The warm-up fills the pipeline: 2 (p - r - 1) + (v - 1) p
// forwards (all of them when m = p).
std::vector<Action> interleaved(int rank, int p, int v, int m) {
  const int total = m * v;
  auto stage_of = [&](int k, bool fwd) {
    const int local = (k % (p * v)) / p;
    return (fwd ? local : v - 1 - local) * p + rank;
  };
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  const int warmup = m == p ? total : std::min(total, 2 * (p - rank - 1) + (v - 1) * p);
  std::vector<Action> out;
  for (int k = 0; k < warmup; ++k) out.push_back(forward(stage_of(k, true), mb_of(k)));
  for (int k = 0; k < total; ++k) {
    if (warmup + k < total)
      out.push_back(forward(stage_of(warmup + k, true), mb_of(warmup + k)));
    out.push_back(backward(stage_of(k, false), mb_of(k)));
  }
  return out;
}

// Breadth first: every microbatch through each local stage in turn, then
// the backwards through the local stages in reverse.
std::vector<Action> looped_bfs(int rank, int p, int v, int m) {
  std::vector<Action> out;
  for (int local = 0; local < v; ++local)
    for (int i = 0; i < m; ++i) out.push_back(forward(local * p + rank, i));
  for (int local = v - 1; local >= 0; --local)
    for (int i = 0; i < m; ++i) out.push_back(backward(local * p + rank, i));
  return out;
}

// ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism"): two stages per
// rank in a V (rank r holds stages r and 2p-1-r, so rank 0 holds the first
// and the last), backward split into the input gradient (I, which the
// previous stage waits for) and the weight gradient (W, which nobody waits
// for and so fills the bubbles).
std::vector<Action> zbv(int rank, int p, int m) {
  const int down = rank, up = 2 * p - 1 - rank;  // the rank's two stages
  int f0 = 0, f1 = 0, i0 = 0, i1 = 0, w0 = 0, w1 = 0;
  std::vector<Action> out;
  auto F = [&](int stage, int& n) { out.push_back(forward(stage, n++)); };
  auto I = [&](int stage, int& n) { out.push_back(Action{ActionKind::INPUT_GRAD, stage, n++}); };
  auto W = [&](int stage, int& n) { out.push_back(Action{ActionKind::WEIGHT_GRAD, stage, n++}); };
  for (int k = 0; k < 2 * (p - rank) - 1; ++k) F(down, f0);
  for (int k = 0; k < rank; ++k) F(up, f1), F(down, f0);
  for (int k = 0; k < p - rank; ++k) F(up, f1), I(up, i1), W(up, w1);
  while (f1 < f0 || f0 < m) {
    if (f0 < m) F(down, f0);
    I(down, i0), W(down, w0);
    F(up, f1), I(up, i1), W(up, w1);
  }
  for (int k = 0; k < rank; ++k) I(down, i0), I(up, i1);
  for (int k = 0; k < p - rank; ++k) I(down, i0), W(down, w0);
  while (w1 < i1) W(up, w1);
  while (w0 < i0) W(down, w0);
  return out;
}

}  // namespace

const char* to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPIPE: return "ScheduleGPipe";
    case ScheduleKind::ONE_F_ONE_B: return "Schedule1F1B";
    case ScheduleKind::INTERLEAVED_1F1B: return "ScheduleInterleaved1F1B";
    case ScheduleKind::LOOPED_BFS: return "ScheduleLoopedBFS";
    case ScheduleKind::ZBV_ZERO_BUBBLE: return "ScheduleZBVZeroBubble";
  }
  return "?";
}

const char* placement_text(ScheduleKind kind) {
  return kind == ScheduleKind::ZBV_ZERO_BUBBLE ? "stage s on rank s, then 2p-1-s: a V"
                                               : "stage s on rank s mod p";
}

bool multi_stage(ScheduleKind kind) {
  return kind == ScheduleKind::INTERLEAVED_1F1B || kind == ScheduleKind::LOOPED_BFS ||
         kind == ScheduleKind::ZBV_ZERO_BUBBLE;
}

std::string check_shape(ScheduleKind kind, int ranks, int stages_per_rank, int m) {
  const auto name = std::string(to_string(kind));
  if (m < 1) return dtrain::detail::cat(name, ": n_microbatches must be at least 1, got ", m);
  if (!multi_stage(kind) && stages_per_rank != 1)
    return dtrain::detail::cat(name, " runs one stage per rank, got ", stages_per_rank);
  if (kind == ScheduleKind::ZBV_ZERO_BUBBLE && stages_per_rank != 2)
    return dtrain::detail::cat(name, " runs two stages per rank (a V), got ", stages_per_rank);
  if (kind == ScheduleKind::ZBV_ZERO_BUBBLE && m < 2 * ranks)
    return dtrain::detail::cat(name, ": n_microbatches (", m, ") must be at least twice the ",
                               "pipeline's ", ranks, " ranks");
  if (kind == ScheduleKind::INTERLEAVED_1F1B && m % ranks != 0)
    return dtrain::detail::cat(name, ": n_microbatches (", m,
                               ") must be a multiple of the pipeline's ", ranks,
               " ranks (microbatches go through the stages in rounds of one per rank)");
  return "";
}

std::vector<Action> order_of(ScheduleKind kind, int rank, int ranks, int stages_per_rank, int m) {
  DTRAIN_ENFORCE(check_shape(kind, ranks, stages_per_rank, m).empty());
  switch (kind) {
    case ScheduleKind::GPIPE: return gpipe(rank, m);
    case ScheduleKind::ONE_F_ONE_B: return one_f_one_b(rank, ranks, m);
    case ScheduleKind::INTERLEAVED_1F1B: return interleaved(rank, ranks, stages_per_rank, m);
    case ScheduleKind::LOOPED_BFS: return looped_bfs(rank, ranks, stages_per_rank, m);
    case ScheduleKind::ZBV_ZERO_BUBBLE: return zbv(rank, ranks, m);
  }
  return {};
}

}  // namespace dtrain::pipelining::detail
