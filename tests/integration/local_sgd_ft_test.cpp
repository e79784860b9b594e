// DiLoCo under a fault-tolerance manager (DiLoCoOptions::manager): replicas
// as threads around an in-process lighthouse. Without failures it is the
// DiLoCo of a fixed group, bitwise; a replica that dies between syncs is
// left out, and when it comes back it takes the outer state (global
// values, outer momentum, clock) from a live peer.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "dtrain/local_sgd.h"
#include "harness/assertions.h"
#include "harness/ft_replicas.h"
#include "harness/local_sgd_model.h"
#include "harness/thread_ranks.h"
#include "optim/optimizer_state.h"

namespace dtrain::local_sgd_ft_test {  // (a namespace of its own: the test binary is a unity build)
namespace {

using namespace std::chrono_literals;
using testing::local_sgd_model::loss_of;
using testing::local_sgd_model::Net;
using testing::local_sgd_model::values_of;

ft::ManagerOptions manager_options(const ft::Lighthouse& lighthouse, const std::string& id) {
  return ft::ManagerOptions()
      .lighthouse(lighthouse.address())
      .replica_id(id)
      .async_quorum(false)
      .heartbeat_interval(50ms)
      .timeout(20s)
      .quorum_timeout(60s);
}

// A replica's training objects, the manager's state holding all of them.
struct FtReplica {
  FtReplica(const ft::Lighthouse& lighthouse, const std::string& id, const local_sgd::DiLoCoOptions& options,
            ft::ManagerOptions manager_opts = {})
      : inner(net->parameters(), torch::optim::AdamWOptions(1e-2)),
        outer(net->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true)),
        manager(state, manager_opts.lighthouse().empty() ? manager_options(lighthouse, id) : manager_opts),
        diloco({net->a->parameters(), net->b->parameters()}, inner, outer,
               local_sgd::DiLoCoOptions(options).manager(&manager)) {
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, inner, *net, "inner/");
    checkpoint::add_optimizer(state, outer, *net, "outer/");
    checkpoint::add_diloco(state, diloco);
  }
  // One inner step on this replica's data at the clock's step.
  void step(int data) {
    inner.zero_grad();
    loss_of(net, data, static_cast<int>(diloco.local_step())).backward();
    diloco.step();
  }
  std::vector<at::Tensor> momentum() {
    std::vector<at::Tensor> out;
    for (const auto& p : net->parameters()) out.push_back(optim::detail::param_state(outer, p).tensors.at(0).second.clone());
    return out;
  }
  Net net;
  torch::optim::AdamW inner;
  torch::optim::SGD outer;
  checkpoint::DistributedState state;
  ft::Manager manager;
  local_sgd::DiLoCo diloco;
};

void expect_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i], b[i])) << what << ": tensor " << i << " differs by "
                                          << (a[i] - b[i]).abs().max().item<double>();
}

// Streaming DiLoCo (two fragments) of two replicas through a manager and
// through a fixed group of two ranks: the same values, bitwise, each sync
// one committed step of the manager.
TEST(DiLoCoWithAManager, WithoutFailuresIsDiLoCoOverAFixedGroupBitwise) {
  constexpr int kSteps = 12;
  const auto options = local_sgd::DiLoCoOptions().sync_every(4);
  std::vector<std::vector<at::Tensor>> fixed(2), managed(2);
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](testing::RankContext& ctx) {
    Net net;
    torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::SGD outer(net->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
    local_sgd::DiLoCo diloco({net->a->parameters(), net->b->parameters()}, inner, outer,
                             local_sgd::DiLoCoOptions(options).group(ctx.group));
    for (int s = 0; s < kSteps; ++s) {
      inner.zero_grad();
      loss_of(net, ctx.rank, s).backward();
      diloco.step();
    }
    fixed[ctx.rank] = values_of(net);
  }, 60s));

  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).min_replicas(2).heartbeat_timeout(1500ms));
  std::vector<int64_t> committed(2);
  testing::run_threads(2, [&](int r) {
    FtReplica replica(lighthouse, r == 0 ? "a" : "b", options,
                      manager_options(lighthouse, r == 0 ? "a" : "b").init_sync(false));
    for (int s = 0; s < kSteps; ++s) replica.step(r);
    managed[r] = values_of(replica.net);
    committed[r] = replica.manager.current_step();
  });
  for (int r = 0; r < 2; ++r) {
    expect_equal(managed[r], fixed[r], "replica " + std::to_string(r));
    EXPECT_EQ(committed[r], 6) << "two fragments, each synced at steps 2 + 4k and 4k: six syncs in 12 steps";
  }
}

// Replica c dies between two syncs (its thread returns: its heartbeat
// connection closes); a and b sync on without it, never failing a sync.
// c comes back with other values and a fresh outer optimizer, heals at its
// first sync from a live peer, and from then on all three hold the same
// global values, outer momentum and clock (and the same parameters where
// a fragment has just synced).
TEST(DiLoCoWithAManager, AReplicaThatDiesBetweenSyncsIsLeftOutAndOnItsReturnTakesTheOuterStateFromAPeer) {
  const auto options = local_sgd::DiLoCoOptions().sync_every(4);
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).heartbeat_timeout(1500ms));
  testing::StartLine start(3);
  std::atomic<int64_t> stop_at{1000};  // committed syncs; set once c is back
  std::atomic<bool> c_healed{false};
  std::vector<std::vector<at::Tensor>> values(3), globals(3), momenta(3);
  std::vector<int64_t> clocks(3), committed(3), failed(3, 0);
  testing::run_threads(3, [&](int r) {
    const std::string id(1, static_cast<char>('a' + r));
    auto finish = [&](FtReplica& replica) {
      values[r] = values_of(replica.net);
      globals[r] = replica.diloco.global_parameters();
      momenta[r] = replica.momentum();
      clocks[r] = replica.diloco.local_step();
      committed[r] = replica.manager.current_step();
    };
    if (r < 2) {
      FtReplica replica(lighthouse, id, options);
      start.arrive_and_wait();
      while (replica.manager.current_step() < stop_at.load()) {
        const int64_t before = replica.manager.current_step();
        replica.step(r);
        const bool synced = replica.diloco.local_step() % 2 == 0;  // (offsets 2 and 4 of H = 4)
        failed[r] += synced && replica.manager.current_step() == before;
      }
      return finish(replica);
    }
    {
      FtReplica first_life(lighthouse, id, options);
      start.arrive_and_wait();
      for (int s = 0; s < 9; ++s) first_life.step(r);  // syncs at 2, 4, 6, 8; dies at 9, between two
    }
    std::this_thread::sleep_for(300ms);
    FtReplica replica(lighthouse, id, options);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : replica.net->parameters()) p.add_(1.0);  // other values than anyone's
    }
    while (replica.manager.current_step() < stop_at.load()) {
      replica.step(r);
      if (!c_healed && replica.manager.quorum().healing) {
        c_healed = true;
        stop_at = replica.manager.current_step() + 4;
      }
    }
    finish(replica);
  });
  EXPECT_TRUE(c_healed.load());
  EXPECT_EQ(failed[0], 0) << "a's syncs all committed through c's death and return";
  EXPECT_EQ(failed[1], 0);
  for (int r = 1; r < 3; ++r) {
    const std::string who = std::string("replica ") + static_cast<char>('a' + r) + " against a";
    EXPECT_EQ(committed[r], committed[0]) << who;
    EXPECT_EQ(clocks[r], clocks[0]) << who;
    // The fragment synced last holds the new global values everywhere; the
    // other one each replica's own steps since its sync.
    const size_t synced = clocks[0] % 4 == 0 ? 2 : 0;  // (fragment 1 syncs at 4k: a.weight, a.bias are 0, 1)
    expect_equal({values[r][synced], values[r][synced + 1]}, {values[0][synced], values[0][synced + 1]},
                 who + ", the parameters of the fragment synced last");
    expect_equal(globals[r], globals[0], who + ", global values");
    expect_equal(momenta[r], momenta[0], who + ", outer momentum");
  }
  EXPECT_GT(committed[0], 6) << "a and b synced on past c's death";
}

// What a heal contributes, against the algorithm written out here: two
// replicas, b started from other values; at the first sync (fragment 0,
// step 2) b heals from a (init_sync) and sends nothing, so the average is
// a's pseudo-gradient alone; b's fragments go back to the global values
// (fragment 1 to its initial ones, not a's two steps); at the second sync
// (fragment 1, step 4) both count. Inner SGD (no state), outer Nesterov.
TEST(DiLoCoWithAManager, AHealingReplicaSendsNothingAndStartsFromTheGlobalValues) {
  using torch::optim::SGD;
  using torch::optim::SGDOptions;
  const auto outer_options = SGDOptions(0.7).momentum(0.9).nesterov(true);
  auto inner_steps = [](Net& net, SGD& inner, int data, int from, int to) {
    for (int s = from; s < to; ++s) {
      inner.zero_grad();
      loss_of(net, data, s).backward();
      inner.step();
    }
  };
  // The algorithm: a's and b's parameters, and a third model holding the
  // global values that the outer optimizer steps.
  Net ref_a, ref_b, global;
  SGD inner_a(ref_a->parameters(), SGDOptions(0.1)), inner_b(ref_b->parameters(), SGDOptions(0.1));
  SGD outer(global->parameters(), outer_options);
  auto params = [](Net& n, int fragment) { return fragment == 0 ? n->a->parameters() : n->b->parameters(); };
  auto outer_step = [&](int fragment, const std::vector<std::vector<at::Tensor>>& deltas) {
    torch::NoGradGuard no_grad;
    auto g = params(global, fragment);
    for (size_t i = 0; i < g.size(); ++i) {
      at::Tensor mean = deltas[0][i] / 2;
      if (deltas.size() == 2) mean = mean + deltas[1][i] / 2;
      g[i].mutable_grad() = mean / (deltas.size() == 2 ? 1.0 : 0.5);  // (the mean over those that sent)
    }
    outer.step();
    for (auto& p : global->parameters()) p.mutable_grad() = at::Tensor();
  };
  auto delta = [&](Net& n, int fragment) {
    std::vector<at::Tensor> out;
    auto g = params(global, fragment), mine = params(n, fragment);
    for (size_t i = 0; i < g.size(); ++i) out.push_back(g[i].detach() - mine[i].detach());
    return out;
  };
  auto take_global = [&](Net& n, int fragment) {
    torch::NoGradGuard no_grad;
    auto g = params(global, fragment), mine = params(n, fragment);
    for (size_t i = 0; i < g.size(); ++i) mine[i].copy_(g[i]);
  };
  inner_steps(ref_a, inner_a, 0, 0, 2);
  outer_step(0, {delta(ref_a, 0)});  // b heals: it sends nothing
  take_global(ref_a, 0);
  take_global(ref_b, 0);
  take_global(ref_b, 1);  // b: a's state, then the global values
  inner_steps(ref_a, inner_a, 0, 2, 4);
  inner_steps(ref_b, inner_b, 1, 2, 4);
  outer_step(1, {delta(ref_a, 1), delta(ref_b, 1)});
  std::vector<at::Tensor> want;
  for (int fragment = 0; fragment < 2; ++fragment) {
    std::vector<at::Tensor> flat;
    for (auto& p : params(global, fragment)) flat.push_back(p.detach().reshape({-1}));
    want.push_back(torch::cat(flat));
  }

  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).min_replicas(2).heartbeat_timeout(1500ms));
  std::vector<std::vector<at::Tensor>> got(2);
  std::vector<bool> healed(2);
  testing::run_threads(2, [&](int r) {
    Net net;
    if (r == 1) {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.add_(1.0);
    }
    SGD inner(net->parameters(), SGDOptions(0.1)), outer_r(net->parameters(), outer_options);
    checkpoint::DistributedState state;
    ft::Manager manager(state, manager_options(lighthouse, r == 0 ? "a" : "b"));
    local_sgd::DiLoCo diloco({net->a->parameters(), net->b->parameters()}, inner, outer_r,
                             local_sgd::DiLoCoOptions().sync_every(4).manager(&manager));
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, outer_r, *net, "outer/");
    checkpoint::add_diloco(state, diloco);
    for (int s = 0; s < 4; ++s) {
      inner.zero_grad();
      loss_of(net, r, static_cast<int>(diloco.local_step())).backward();
      diloco.step();
      if (s == 1) healed[r] = manager.quorum().healing;
    }
    got[r] = diloco.global_parameters();
  });
  EXPECT_FALSE(healed[0]);
  EXPECT_TRUE(healed[1]) << "init_sync: b takes a's state at the first sync";
  for (int r = 0; r < 2; ++r) expect_equal(got[r], want, std::string("replica ") + (r == 0 ? "a" : "b"));
}

// A member that dies inside a sync (c: in the quorum, gone before the
// average): the sync fails on a and b, is dropped there (the fragment back
// to its global values, no outer step, the manager's step not counted),
// and the next sync commits without c.
TEST(DiLoCoWithAManager, ASyncAMemberDiesInIsDroppedAndTheNextCommitsWithoutIt) {
  const auto options = local_sgd::DiLoCoOptions().sync_every(4);
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).heartbeat_timeout(1500ms));
  testing::StartLine start(3);
  Net fresh;
  const auto initial = values_of(fresh);
  std::vector<std::vector<at::Tensor>> after_drop(2), globals_after_drop(2);
  std::vector<int64_t> after_first(2), after_second(2);
  testing::run_threads(3, [&](int r) {
    const std::string id(1, static_cast<char>('a' + r));
    FtReplica replica(lighthouse, id, options, manager_options(lighthouse, id).init_sync(false));
    start.arrive_and_wait();
    if (r == 2) {
      replica.manager.start_quorum();  // in the first sync's quorum, then gone
      return;
    }
    replica.step(r);
    replica.step(r);  // step 2: fragment 0's sync, which c leaves
    after_first[r] = replica.manager.current_step();
    after_drop[r] = values_of(replica.net);
    globals_after_drop[r] = replica.diloco.global_parameters();
    replica.step(r);
    replica.step(r);  // step 4: fragment 1's, without c
    after_second[r] = replica.manager.current_step();
  });
  for (int r = 0; r < 2; ++r) {
    const std::string who = std::string("replica ") + static_cast<char>('a' + r);
    EXPECT_EQ(after_first[r], 0) << who << ": the sync c died in did not commit";
    EXPECT_EQ(after_second[r], 1) << who << ": the next one did";
    expect_equal({after_drop[r][0], after_drop[r][1]}, {initial[0], initial[1]},
                 who + ": fragment 0 back to its global (initial) values");
    expect_equal({globals_after_drop[r][0]}, {torch::cat({initial[0].reshape({-1}), initial[1].reshape({-1})})},
                 who + ": no outer step");
  }
}

TEST(DiLoCoWithAManager, BadInputIsRefusedByName) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).min_replicas(2).heartbeat_timeout(1500ms));
  {
    Net net;
    torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::SGD outer(net->parameters(), torch::optim::SGDOptions(0.7));
    checkpoint::DistributedState state;
    ft::Manager asynchronous(state, manager_options(lighthouse, "x").async_quorum(true));
    ft::Manager manager(state, manager_options(lighthouse, "y"));
    auto with = [&](local_sgd::DiLoCoOptions o) {
      return testing::what_thrown<InvalidArgument>(
          [&] { local_sgd::DiLoCo({net->parameters()}, inner, outer, o.sync_every(4)); });
    };
    EXPECT_NE(with(local_sgd::DiLoCoOptions().manager(&asynchronous)).find("needs ManagerOptions().async_quorum(false)"),
              std::string::npos);
    auto alone = create_process_group("tcp", std::make_shared<HashStore>(30s), 0, 1, GroupOptions().name("alone"));
    EXPECT_NE(with(local_sgd::DiLoCoOptions().manager(&manager).group(alone))
                  .find("a manager and a group were both given"),
              std::string::npos);
    EXPECT_NE(with(local_sgd::DiLoCoOptions().manager(&manager).sync_delay(1)).find("sync_delay 1 with a manager"),
              std::string::npos);
  }
  // Replicas that would sync at different steps: each names its own at the
  // first sync they share.
  std::vector<std::string> errors(2);
  testing::run_threads(2, [&](int r) {
    FtReplica replica(lighthouse, r == 0 ? "a" : "b", local_sgd::DiLoCoOptions().sync_every(r == 0 ? 8 : 4));
    errors[r] = testing::what_thrown<InvalidArgument>([&] {
      for (int s = 0; s < 8; ++s) replica.step(r);
    });
  });
  EXPECT_EQ(errors[0].rfind("DiLoCo: the replicas of quorum ", 0), 0u) << errors[0];
  EXPECT_NE(errors[0].find(" differ in sync_every (this one has 8): every replica must sync the same fragments"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find(" differ in sync_every (this one has 4)"), std::string::npos) << errors[1];
}

}  // namespace
}  // namespace dtrain::local_sgd_ft_test
