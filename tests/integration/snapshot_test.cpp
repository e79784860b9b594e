// Snapshots in a peer's memory (checkpoint/snapshot.h), with thread ranks
// and two keepers standing for two hosts' dtrain-run (ranks 0, 1 on host
// A, ranks 2, 3 on host B). The launched form, hosts lost whole, is
// tests/launcher/netns_snapshot_test.sh.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>

#include "checkpoint/storage/keepers/keeper.h"
#include "checkpoint/storage/keepers/seam.h"
#include "dtrain/checkpoint/snapshot.h"
#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/fsdp_models.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
using testing::run_rank_contexts;
namespace ckpt = checkpoint;

constexpr int kSnapWorld = 4;

auto snap_models(int seed) { return testing::seeded_stacks(kSnapWorld, seed); }

torch::Tensor snap_batch(int step, int rank) {
  static const std::vector<torch::Tensor> inputs = [] {
    torch::manual_seed(77);
    std::vector<torch::Tensor> out;
    for (int i = 0; i < 8 * kSnapWorld; ++i) out.push_back(torch::randn({4, 3, 10}));
    return out;
  }();
  return inputs.at(step * kSnapWorld + rank);
}

struct Trainer {
  Trainer(std::shared_ptr<testing::BlockStackImpl> model, RankContext& ctx)
      : fsdp(std::move(model), FSDPOptions().process_group(ctx.group)),
        adam(fsdp.parameters(), torch::optim::AdamOptions(1e-2)),
        rank(ctx.rank) {
    ckpt::add_fsdp(state, fsdp, adam);
  }
  void train(int from, int to) {
    for (int s = from; s < to; ++s) {
      adam.zero_grad();
      fsdp.forward(snap_batch(s, rank)).pow(2).mean().backward();
      adam.step();
    }
  }
  FullyShardedDataParallel<testing::BlockStackImpl> fsdp;
  torch::optim::Adam adam;
  ckpt::DistributedState state;
  int rank;
};

class Snapshot : public ::testing::Test {
 protected:
  std::unique_ptr<snapshot::Keeper> a = keeper(), b = keeper();
  static std::unique_ptr<snapshot::Keeper> keeper(uint64_t limit = 1ull << 30) {
    return std::make_unique<snapshot::Keeper>("/tmp", limit);
  }
  ckpt::SnapshotOptions on_host(RankContext& ctx) const {
    return ckpt::SnapshotOptions().process_group(ctx.group).keeper_socket(
        (ctx.rank < 2 ? a : b)->socket_path());
  }
};

// Host B lost after the snapshot of step 3 (its keeper replaced by an
// empty one): a fresh job restores step 3 (ranks 2 and 3 from host A's
// keeper) and trains on bitwise as the uninterrupted run.
TEST_F(Snapshot, ALostHostsRanksResumeFromTheOtherHostsKeeperBitwise) {
  auto straight = snap_models(1), first = snap_models(1), second = snap_models(2);
  std::vector<std::map<std::string, at::Tensor>> want(kSnapWorld);
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(straight[ctx.rank], ctx);
    t.train(0, 6);
    want[ctx.rank] = t.fsdp.full_state_dict();
    Trainer f(first[ctx.rank], ctx);
    f.train(0, 4);
    const auto info = ckpt::snapshot(3, f.state, on_host(ctx));
    EXPECT_GT(info.part_bytes, 0u);
    EXPECT_EQ(info.sent_bytes, info.part_bytes);  // two hosts: a second copy on the other
  }, 120s);
  testing::expect_no_errors(errors);
  // A part of a newer snapshot, never completed: never used.
  a->handle({snapshot_wire::Op::Put, 5, 0, kSnapWorld, std::string(64, 'x')});
  b = keeper();
  errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(second[ctx.rank], ctx);
    const auto step = ckpt::restore_snapshot(t.state, -1, on_host(ctx));
    ASSERT_TRUE(step.has_value());
    EXPECT_EQ(*step, 3);
    t.train(4, 6);
    for (const auto& [name, value] : t.fsdp.full_state_dict())
      EXPECT_TRUE(torch::equal(value, want[ctx.rank].at(name))) << "rank " << ctx.rank << " " << name;
  }, 120s);
  testing::expect_no_errors(errors);
}

// async_snapshot: training steps on the moment it returns; the snapshot
// holds the state at the call. The next snapshot call waits for it.
TEST_F(Snapshot, AnAsynchronousSnapshotHoldsTheStateAtTheCall) {
  auto straight = snap_models(1), first = snap_models(1), second = snap_models(2);
  std::vector<std::map<std::string, at::Tensor>> want(kSnapWorld);
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    auto transfers = create_process_group("tcp", std::make_shared<PrefixStore>("transfers", ctx.store), ctx.rank,
                                          kSnapWorld, GroupOptions().name("transfers").timeout(60s));
    Trainer t(straight[ctx.rank], ctx);
    t.train(0, 6);
    want[ctx.rank] = t.fsdp.full_state_dict();
    Trainer f(first[ctx.rank], ctx);
    f.train(0, 4);
    auto pending = ckpt::async_snapshot(3, f.state, on_host(ctx).transfer_group(transfers));
    f.train(4, 7);  // overwrites every tensor of the state while it is sent
    const auto info = pending.wait();
    EXPECT_TRUE(pending.done());
    EXPECT_EQ(info.step, 3);
    EXPECT_EQ(info.sent_bytes, info.part_bytes);
    try {
      ckpt::async_snapshot(4, f.state, on_host(ctx).transfer_group(ctx.group));
      ADD_FAILURE() << "the snapshot's own group taken for its transfers";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "transfer_group must not be the snapshot's group")) << e.what();
    }
  }, 120s);
  testing::expect_no_errors(errors);
  b = keeper();
  errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(second[ctx.rank], ctx);
    EXPECT_EQ(ckpt::restore_snapshot(t.state, -1, on_host(ctx)).value_or(-1), 3);
    t.train(4, 6);
    for (const auto& [name, value] : t.fsdp.full_state_dict())
      EXPECT_TRUE(torch::equal(value, want[ctx.rank].at(name))) << "rank " << ctx.rank << " " << name;
  }, 120s);
  testing::expect_no_errors(errors);
}

// DDP: each replicated entry is in one rank's part only (save()'s plan),
// so a rank's part is about 1/world of the state; restoring sends each
// entry from its part to every rank, host B's parts again from A's keeper.
TEST_F(Snapshot, ReplicatedEntriesAreKeptOnceAndReachEveryRank) {
  auto models = snap_models(1), fresh = snap_models(2);
  std::vector<std::map<std::string, at::Tensor>> want(kSnapWorld);
  int64_t whole = 0;
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], DDPOptions().process_group(ctx.group));
    torch::optim::Adam adam(ddp.parameters(), torch::optim::AdamOptions(1e-2));
    for (int s = 0; s < 2; ++s) {
      adam.zero_grad();
      ddp.forward(snap_batch(s, ctx.rank)).pow(2).mean().backward();
      adam.step();
    }
    ckpt::DistributedState state;
    ckpt::add_module(state, *models[ctx.rank]);
    ckpt::add_optimizer(state, adam, *models[ctx.rank]);
    const auto info = ckpt::snapshot(1, state, on_host(ctx));
    int64_t bytes = 0;
    for (const auto& [name, t] : state.replicated) bytes += t.nbytes();
    if (ctx.rank == 0) whole = bytes;
    EXPECT_LT(info.part_bytes, static_cast<uint64_t>(bytes) / 2) << "rank " << ctx.rank;
    for (const auto& [name, t] : state.replicated) want[ctx.rank][name] = t.clone();
  }, 120s);
  testing::expect_no_errors(errors);
  b = keeper();
  errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    torch::optim::Adam adam(fresh[ctx.rank]->parameters(), torch::optim::AdamOptions(1e-2));
    ckpt::DistributedState state;
    ckpt::add_module(state, *fresh[ctx.rank]);
    ckpt::add_optimizer(state, adam, *fresh[ctx.rank]);
    EXPECT_EQ(ckpt::restore_snapshot(state, -1, on_host(ctx)).value_or(-1), 1);
    for (const auto& [name, t] : state.replicated)
      EXPECT_TRUE(torch::equal(t, want[ctx.rank].at(name))) << "rank " << ctx.rank << " " << name;
  }, 120s);
  testing::expect_no_errors(errors);
  EXPECT_GT(whole, 0);
}

// A snapshot no newer than the disk's, none at all, and one the state does
// not fit: nullopt or InvalidArgument, the state untouched.
TEST_F(Snapshot, OlderMissingOrMisfittingSnapshotsLeaveTheStateUntouched) {
  auto models = snap_models(1), fresh = snap_models(2);
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(models[ctx.rank], ctx);
    EXPECT_FALSE(ckpt::restore_snapshot(t.state, -1, on_host(ctx)).has_value());  // none yet
    t.train(0, 1);
    ckpt::snapshot(0, t.state, on_host(ctx));
    Trainer u(fresh[ctx.rank], ctx);
    const auto before = u.fsdp.full_state_dict();
    EXPECT_FALSE(ckpt::restore_snapshot(u.state, 0, on_host(ctx)).has_value());  // not newer than 0
    ckpt::DistributedState other = u.state;
    other.replicated["extra"] = at::zeros({2});
    try {
      ckpt::restore_snapshot(other, -1, on_host(ctx));
      ADD_FAILURE() << "a state with an entry the snapshot lacks was filled";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "checkpoint::restore_snapshot: rank 0: ")) << e.what();
      EXPECT_TRUE(testing::Contains(e.what(), "no rank's part of the snapshot holds extra, which this rank's state holds")) << e.what();
    }
    for (const auto& [name, value] : u.fsdp.full_state_dict())
      EXPECT_TRUE(torch::equal(value, before.at(name))) << name;
  }, 120s);
  testing::expect_no_errors(errors);
}

// A keeper over its memory limit fails the snapshot on every rank, naming
// the variable; the previous snapshot stays the complete one.
TEST_F(Snapshot, AKeeperOverItsLimitFailsTheSnapshotEverywhereAndKeepsThePrevious) {
  auto models = snap_models(1);
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(models[ctx.rank], ctx);
    const auto info = ckpt::snapshot(0, t.state, on_host(ctx));
    ctx.group->barrier()->wait();
    // Host B's keeper is replaced by one that can hold one part, not two
    // (its own ranks' and the replicas of host A's): rank 2's is refused.
    if (ctx.rank == 0) b = keeper(info.part_bytes * 3 / 2);
    ctx.group->barrier()->wait();
    t.train(0, 1);
    try {
      ckpt::snapshot(1, t.state, on_host(ctx));
      ADD_FAILURE() << "a snapshot past the keeper's limit succeeded";
    } catch (const Error& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "checkpoint::snapshot of step 1: rank 2: ")) << e.what();
      EXPECT_TRUE(testing::Contains(e.what(), "DTRAIN_SNAPSHOT_MEMORY")) << e.what();
    }
    EXPECT_EQ(ckpt::restore_snapshot(t.state, -1, on_host(ctx)).value_or(-1), 0);
  }, 120s);
  testing::expect_no_errors(errors);
}

// Every rank has a receive from the rank on the other host posted on the
// group ahead of a snapshot (tag 0, the shape of the snapshot's size
// messages), as a user's overlapped exchange would. The snapshot goes
// through, and each receive gets the user's own message sent after it.
// Before, the parts travelled on tag 0 of the same group: the user's
// receives took the snapshot's size messages, and the snapshot waited for
// its own until the group's timeout.
TEST_F(Snapshot, AReceivePostedAheadOnTheGroupTakesNothingOfTheSnapshot) {
  auto models = snap_models(1);
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(models[ctx.rank], ctx);
    t.train(0, 1);
    const int peer = (ctx.rank + 2) % kSnapWorld;
    at::Tensor got = at::zeros({1}, at::kLong);
    auto pending = irecv(got, peer, P2POptions().group(ctx.group));
    const auto info = ckpt::snapshot(0, t.state, on_host(ctx));
    EXPECT_GT(info.part_bytes, 0u);
    send(at::full({1}, int64_t{1000 + ctx.rank}, at::kLong), peer, P2POptions().group(ctx.group));
    pending->wait();
    EXPECT_EQ(got.item<int64_t>(), 1000 + peer) << "rank " << ctx.rank << "'s own receive";
  }, 20s);
  testing::expect_no_errors(errors);
}

// Rank 2's keeper refuses the commit once every part is kept (the seam):
// every rank throws the same Error naming rank 2, as snapshot.h says.
// Before, the commit was not agreed: rank 2 threw, the others returned.
TEST_F(Snapshot, ACommitRefusedOnOneRankFailsEveryRankAlike) {
  auto models = snap_models(1);
  std::vector<std::string> thrown(kSnapWorld);
  ckpt::detail::refuse_snapshot_commit_on(2);
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(models[ctx.rank], ctx);
    t.train(0, 1);
    try {
      ckpt::snapshot(0, t.state, on_host(ctx));
    } catch (const Error& e) {
      thrown[ctx.rank] = e.what();
    }
  }, 20s);
  ckpt::detail::refuse_snapshot_commit_on(-1);
  testing::expect_no_errors(errors);
  for (int r = 0; r < kSnapWorld; ++r)
    EXPECT_EQ(thrown[r], "checkpoint::snapshot of step 0: rank 2: checkpoint::snapshot of step 0: this host's "
                         "keeper refused the commit (the test seam)") << "rank " << r;
}

// Three hosts (keepers a: rank 0; b: rank 1; c: ranks 2, 3; a part's
// second copy on the next host: a holds parts 0, 2, 3, b parts 1, 0, c
// parts 2, 3, 1). The snapshot of step 1 is kept everywhere and agreed,
// then committed on b and c only: host a's rank is stopped before its
// commit (the seam stands for a kill landing there). Host c is lost. Step 1
// is restored from b's commit and a's uncommitted parts, and training goes
// on bitwise as the uninterrupted run. Before, a keeper listed its
// committed snapshot only: a listed step 0, b step 1, and neither step had
// every part (the job started over, seen once in 18 kills of
// bench/scripts/ft_kills_netns.sh's baseline).
TEST_F(Snapshot, ACommitThatReachedSomeKeepersOnlyIsRestoredAfterAHostIsLost) {
  auto c = keeper();
  auto three_hosts = [&](RankContext& ctx) {
    const auto& k = ctx.rank == 0 ? a : ctx.rank == 1 ? b : c;
    return ckpt::SnapshotOptions().process_group(ctx.group).keeper_socket(k->socket_path());
  };
  auto straight = snap_models(1), first = snap_models(1), second = snap_models(2);
  std::vector<std::map<std::string, at::Tensor>> want(kSnapWorld);
  std::vector<std::string> thrown(kSnapWorld);
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(straight[ctx.rank], ctx);
    t.train(0, 4);
    want[ctx.rank] = t.fsdp.full_state_dict();
    Trainer f(first[ctx.rank], ctx);
    f.train(0, 1);
    ckpt::snapshot(0, f.state, three_hosts(ctx));
    f.train(1, 2);
    if (ctx.rank == 0) ckpt::detail::refuse_snapshot_commit_on(0);
    ctx.group->barrier();
    try {
      ckpt::snapshot(1, f.state, three_hosts(ctx));
    } catch (const Error& e) {
      thrown[ctx.rank] = e.what();
    }
  }, 120s);
  ckpt::detail::refuse_snapshot_commit_on(-1);
  testing::expect_no_errors(errors);
  for (int r = 0; r < kSnapWorld; ++r) EXPECT_NE(thrown[r], "") << "rank " << r << ": the seam stopped rank 0";
  c = keeper();
  errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    Trainer t(second[ctx.rank], ctx);
    const auto step = ckpt::restore_snapshot(t.state, -1, three_hosts(ctx));
    ASSERT_EQ(step, std::optional<int64_t>(1)) << "rank " << ctx.rank;
    t.train(2, 4);
    const auto got = t.fsdp.full_state_dict();
    for (const auto& [name, value] : want[ctx.rank])
      EXPECT_TRUE(at::equal(got.at(name), value)) << "rank " << ctx.rank << ": " << name;
  }, 120s);
  testing::expect_no_errors(errors);
}

// Two groups of the same ranks (the default one and "second") snapshot the
// same step on the same keepers, each its own values of one tensor: each
// restores its own. Before, a keeper told parts apart by step, world and
// rank only: the second group's snapshot replaced the first's, and the
// first group restored the second's values without a word.
TEST_F(Snapshot, TwoGroupsOfTheSameRanksKeepTheirSnapshotsApart) {
  auto errors = run_rank_contexts(kSnapWorld, [&](RankContext& ctx) {
    auto second = create_process_group("tcp", std::make_shared<PrefixStore>("second", ctx.store), ctx.rank,
                                       kSnapWorld, GroupOptions().name("second").timeout(20s));
    auto state_of = [](float value) {
      ckpt::DistributedState s;
      s.replicated["w"] = at::full({4}, value);
      return s;
    };
    ckpt::snapshot(0, state_of(1), on_host(ctx));
    ckpt::snapshot(0, state_of(2), on_host(ctx).process_group(second));
    auto mine = state_of(0), theirs = state_of(0);
    EXPECT_EQ(ckpt::restore_snapshot(mine, -1, on_host(ctx)), std::optional<int64_t>(0));
    EXPECT_EQ(ckpt::restore_snapshot(theirs, -1, on_host(ctx).process_group(second)), std::optional<int64_t>(0));
    EXPECT_TRUE(at::equal(mine.replicated["w"], at::full({4}, 1.0f))) << "rank " << ctx.rank << ": " << mine.replicated["w"];
    EXPECT_TRUE(at::equal(theirs.replicated["w"], at::full({4}, 2.0f))) << "rank " << ctx.rank;
  }, 20s);
  testing::expect_no_errors(errors);
}

TEST(SnapshotWithoutLauncher, IsRefusedNamingTheVariable) {
  ckpt::DistributedState state;
  try {
    ckpt::snapshot(0, state, ckpt::SnapshotOptions().keeper_socket(""));
    ADD_FAILURE() << "no keeper, yet a snapshot";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(testing::Contains(e.what(), "no snapshot keeper: run under dtrain-run, which sets DTRAIN_SNAPSHOT_SOCKET"))
        << e.what();
  }
}

}  // namespace
}  // namespace dtrain
