// The schedules' orders, run on a model of the pipeline: every rank
// executes its actions one after another, a forward waits for the previous
// stage's forward of its microbatch and a backward for the next stage's
// backward (sends never block: the runtime posts its receives ahead). Each
// order must cover every action once on the right rank, never deadlock,
// and have the bubble of its theory.

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "pipelining/orders.h"

namespace dtrain::pipelining::detail {
namespace {

struct Simulated {
  bool deadlocked = false;
  double makespan = 0;
  std::vector<double> idle_fraction;  // per rank
  std::vector<int> peak_held;         // per rank: most microbatches between F and B
};

// Forward costs 1 and backward 2 on every stage (a split backward: 1 for
// the input gradient, 1 for the weights').
Simulated simulate(ScheduleKind kind, int p, int v, int m) {
  const int stages = p * v;
  std::vector<std::vector<Action>> orders;
  for (int r = 0; r < p; ++r) orders.push_back(order_of(kind, r, p, v, m));
  // (what, stage, mb) -> end time; what: 0 forward, 1 input gradient
  // (a whole backward gives it too), 2 weights' gradient.
  std::map<std::tuple<int, int, int>, double> done;
  std::vector<size_t> next(p, 0);
  std::vector<double> free_at(p, 0), busy(p, 0);
  std::vector<int> held(p, 0);
  Simulated out;
  out.peak_held.assign(p, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      while (next[r] < orders[r].size()) {
        const Action a = orders[r][next[r]];
        const bool fwd = a.kind == ActionKind::FORWARD;
        const bool weights = a.kind == ActionKind::WEIGHT_GRAD;
        std::vector<std::tuple<int, int, int>> deps;
        if (fwd && a.stage > 0) deps.emplace_back(0, a.stage - 1, a.microbatch);
        if (weights) deps.emplace_back(1, a.stage, a.microbatch);
        if (!fwd && !weights) {
          deps.emplace_back(0, a.stage, a.microbatch);
          if (a.stage < stages - 1) deps.emplace_back(1, a.stage + 1, a.microbatch);
        }
        double start = free_at[r];
        bool ready = true;
        for (const auto& d : deps) {
          auto it = done.find(d);
          if (it == done.end()) ready = false;
          else start = std::max(start, it->second);
        }
        if (!ready) break;
        const double cost = a.kind == ActionKind::BACKWARD ? 2 : 1;
        free_at[r] = start + cost;
        busy[r] += cost;
        done[{fwd ? 0 : weights ? 2 : 1, a.stage, a.microbatch}] = free_at[r];
        // Activations are held from the forward to the last use of the graph.
        if (fwd) ++held[r];
        if (a.kind == ActionKind::BACKWARD || weights) --held[r];
        out.peak_held[r] = std::max(out.peak_held[r], held[r]);
        ++next[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r) out.deadlocked |= next[r] != orders[r].size();
  out.makespan = *std::max_element(free_at.begin(), free_at.end());
  for (int r = 0; r < p; ++r) out.idle_fraction.push_back(1 - busy[r] / out.makespan);
  return out;
}

const ScheduleKind kAll[] = {ScheduleKind::GPIPE, ScheduleKind::ONE_F_ONE_B,
                             ScheduleKind::INTERLEAVED_1F1B, ScheduleKind::LOOPED_BFS,
                             ScheduleKind::ZBV_ZERO_BUBBLE};

// Each action's kind counts: a whole backward is one of each half.
int kinds_of(ActionKind k) { return k == ActionKind::BACKWARD ? 2 : 1; }

TEST(PipelineOrders, EveryActionOnceOnTheRankThatHoldsItsStage) {
  for (auto kind : kAll)
    for (int p : {1, 2, 3, 4})
      for (int v : kind == ScheduleKind::ZBV_ZERO_BUBBLE ? std::vector<int>{2}
                   : multi_stage(kind)                     ? std::vector<int>{1, 2, 3}
                                                           : std::vector<int>{1})
        for (int m : {1, 2, 4, 6, 8, 12}) {
          if (!check_shape(kind, p, v, m).empty()) continue;
          SCOPED_TRACE(std::string(to_string(kind)) + " p=" + std::to_string(p) +
                       " v=" + std::to_string(v) + " m=" + std::to_string(m));
          std::set<std::tuple<int, int, int>> seen;
          int halves = 0;
          for (int r = 0; r < p; ++r)
            for (const auto& a : order_of(kind, r, p, v, m)) {
              EXPECT_EQ(rank_of_stage(kind, a.stage, p), r);
              EXPECT_GE(a.microbatch, 0);
              EXPECT_LT(a.microbatch, m);
              EXPECT_TRUE(seen.insert({static_cast<int>(a.kind), a.stage, a.microbatch}).second);
              halves += a.kind == ActionKind::FORWARD ? 2 : kinds_of(a.kind);
            }
          // A forward and both halves of a backward per stage and microbatch.
          EXPECT_EQ(halves, 4 * p * v * m);
          EXPECT_FALSE(simulate(kind, p, v, m).deadlocked);
        }
}

// The bubble of GPipe and 1F1B is (p - 1) / (m + p - 1) on every rank; the
// interleaved schedule's is (p - 1) / (vm + p - 1) within 15%.
TEST(PipelineOrders, TheBubbleIsTheTheorys) {
  for (int p : {2, 4})
    for (int m : {4, 8, 16}) {
      const double theory = (p - 1.0) / (m + p - 1.0);
      for (auto kind : {ScheduleKind::GPIPE, ScheduleKind::ONE_F_ONE_B})
        for (double idle : simulate(kind, p, 1, m).idle_fraction)
          EXPECT_NEAR(idle, theory, 1e-9) << to_string(kind) << " p=" << p << " m=" << m;
      const double interleaved = (p - 1.0) / (2 * m + p - 1.0);
      for (double idle : simulate(ScheduleKind::INTERLEAVED_1F1B, p, 2, m).idle_fraction)
        EXPECT_LE(idle, interleaved * 1.15 + 1e-9) << "p=" << p << " m=" << m;
    }
}

// 1F1B keeps at most p - r microbatches' activations on rank r; GPipe all m.
// Zero bubble: with the weights' gradients filling the gaps, ZB-V idles
// less than 1F1B on as many ranks (each rank holding two half stages).
TEST(PipelineOrders, ZeroBubbleIdlesLessThan1F1B) {
  for (int p : {2, 4})
    for (int m : {8, 16}) {
      const auto zbv = simulate(ScheduleKind::ZBV_ZERO_BUBBLE, p, 2, m);
      const double one_f_one_b = (p - 1.0) / (m + p - 1.0);
      for (double idle : zbv.idle_fraction)
        EXPECT_LT(idle, one_f_one_b) << "p=" << p << " m=" << m;
    }
}

TEST(PipelineOrders, OneFOneBHoldsFewerMicrobatchesThanGPipe) {
  const int p = 4, m = 16;
  const auto f1b1 = simulate(ScheduleKind::ONE_F_ONE_B, p, 1, m);
  const auto gpipe = simulate(ScheduleKind::GPIPE, p, 1, m);
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(f1b1.peak_held[r], p - r);
    EXPECT_EQ(gpipe.peak_held[r], m);
  }
}

TEST(PipelineOrders, ShapesTheScheduleCannotRunAreNamed) {
  EXPECT_EQ(check_shape(ScheduleKind::INTERLEAVED_1F1B, 2, 2, 3),
            "ScheduleInterleaved1F1B: n_microbatches (3) must be a multiple of the pipeline's 2 "
            "ranks (microbatches go through the stages in rounds of one per rank)");
  EXPECT_EQ(check_shape(ScheduleKind::GPIPE, 2, 2, 4),
            "ScheduleGPipe runs one stage per rank, got 2");
  EXPECT_EQ(check_shape(ScheduleKind::ZBV_ZERO_BUBBLE, 2, 1, 8),
            "ScheduleZBVZeroBubble runs two stages per rank (a V), got 1");
  EXPECT_EQ(check_shape(ScheduleKind::ZBV_ZERO_BUBBLE, 4, 2, 6),
            "ScheduleZBVZeroBubble: n_microbatches (6) must be at least twice the pipeline's 4 "
            "ranks");
  EXPECT_EQ(check_shape(ScheduleKind::ONE_F_ONE_B, 2, 1, 0),
            "Schedule1F1B: n_microbatches must be at least 1, got 0");
}

}  // namespace
}  // namespace dtrain::pipelining::detail
