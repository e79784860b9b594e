// Asynchronous distributed checkpoints (checkpoint::async_save): what is
// written is the state at the call, whatever training does to it after;
// one save of a group in flight; a failure reaches every rank's handle and,
// unseen, the next save. (A rank killed during one: process_test's
// CheckpointCrash.)

#include <gtest/gtest.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>

#include <cerrno>

#include "dtrain/dtrain.h"
#include "harness/assembled_state.h"
#include "harness/assertions.h"
#include "harness/fsdp_models.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
using testing::run_rank_contexts;
namespace ckpt = checkpoint;

// The writer's own group: the saving group's ranks over the shared store.
std::shared_ptr<ProcessGroup> writer_group(RankContext& ctx) {
  return create_process_group("tcp", std::make_shared<PrefixStore>("writer", ctx.store), ctx.rank,
                              ctx.world, GroupOptions().name("writer").timeout(20s));
}

ckpt::AsyncSaveOptions async_options(RankContext& ctx, const std::shared_ptr<ProcessGroup>& writers) {
  return ckpt::AsyncSaveOptions().process_group(ctx.group).writer_group(writers);
}

std::vector<at::Tensor> state_tensors(const ckpt::DistributedState& state) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : state.replicated) out.push_back(t);
  for (const auto& [name, s] : state.sharded) out.push_back(s.local);
  return out;
}

// FSDP and Adam after 3 steps, saved asynchronously; the moment it
// returns, every tensor of the state is overwritten (as training would, a
// step later), and training goes on while the writer runs. The checkpoint
// holds the values at the call, bitwise, parameters and Adam's moments.
TEST(AsyncSave, WritesTheStateAtTheCallWhileTrainingChangesIt) {
  testing::TempDir dir;
  testing::AssembledState at_call, loaded;
  std::vector<std::shared_ptr<testing::BlockStackImpl>> nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(0);
    nets.push_back(std::make_shared<testing::BlockStackImpl>());
  }
  const auto input = torch::randn({4, 3, 10});
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto writers = writer_group(ctx);
    FullyShardedDataParallel fsdp(nets[ctx.rank], FSDPOptions().process_group(ctx.group));
    torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(1e-2));
    auto step = [&] {
      opt.zero_grad();
      fsdp.forward(input + ctx.rank).pow(2).mean().backward();
      opt.step();
    };
    for (int i = 0; i < 3; ++i) step();
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, fsdp, opt);
    state.metadata["step"] = "3";
    at_call.add(state);
    auto pending = ckpt::async_save(dir.path(), state, async_options(ctx, writers));
    {
      torch::NoGradGuard no_grad;
      for (auto& t : state_tensors(state)) t.fill_(-1.0);
    }
    state.metadata["step"] = "changed";
    step();
    pending.wait();
    EXPECT_TRUE(pending.done());
    EXPECT_FALSE(pending.error());
    EXPECT_EQ(pending.dir(), dir.path());
    ckpt::load(dir.path(), state);
    EXPECT_EQ(state.metadata.at("step"), "3");
    loaded.add(state);
  }, 60s);
  testing::expect_no_errors(errors);
  EXPECT_GT(at_call.size(), 20u);
  at_call.expect_equal(loaded);
}

// stage_in_background: async_save returns before the copy; the moment
// wait_staged() returns every tensor of the state is overwritten and
// training steps on. The checkpoint holds the values at the call, bitwise.
TEST(AsyncSave, StagedInTheBackgroundTheStateMayChangeOnceStaged) {
  testing::TempDir dir;
  testing::AssembledState at_call, loaded;
  std::vector<std::shared_ptr<testing::BlockStackImpl>> nets = testing::seeded_stacks(2, 0);
  const auto input = torch::randn({4, 3, 10});
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto writers = writer_group(ctx);
    FullyShardedDataParallel fsdp(nets[ctx.rank], FSDPOptions().process_group(ctx.group));
    torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(1e-2));
    for (int i = 0; i < 2; ++i) {
      opt.zero_grad();
      fsdp.forward(input + ctx.rank).pow(2).mean().backward();
      opt.step();
    }
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, fsdp, opt);
    at_call.add(state);
    auto pending = ckpt::async_save(dir.path(), state, async_options(ctx, writers).stage_in_background(true));
    pending.wait_staged();  // at once: the state changes the moment it returns
    {
      torch::NoGradGuard no_grad;
      for (auto& t : state_tensors(state)) t.fill_(-1.0);
    }
    opt.zero_grad();
    fsdp.forward(input + ctx.rank).pow(2).mean().backward();
    opt.step();
    pending.wait();
    ckpt::load(dir.path(), state);
    loaded.add(state);
  }, 60s);
  testing::expect_no_errors(errors);
  EXPECT_GT(at_call.size(), 20u);
  at_call.expect_equal(loaded);
}

// The second async_save returns only once the first is done, a save after
// them waits the same way, and all three checkpoints hold their values.
TEST(AsyncSave, OneSaveOfAGroupIsInFlightAtATime) {
  testing::TempDir dir;
  auto errors = run_rank_contexts(3, [&](RankContext& ctx) {
    auto writers = writer_group(ctx);
    auto value = torch::arange(4, torch::kFloat) + 4 * ctx.rank;
    ckpt::DistributedState state;
    state.sharded["w"] = ckpt::ShardedTensor{value, 4 * ctx.rank, 12};
    state.replicated["r"] = torch::full({1 << 16}, 3.0f);
    std::vector<ckpt::AsyncSaveHandle> saves;
    for (const std::string name : {"a", "b"}) {
      value.add_(100);
      state.metadata["name"] = name;
      saves.push_back(ckpt::async_save(dir / name, state, async_options(ctx, writers)));
    }
    EXPECT_TRUE(saves[0].done()) << "the second async_save did not wait for the first";
    value.add_(100);
    state.metadata["name"] = "c";
    ckpt::save(dir / "c", state, ckpt::SaveOptions().process_group(ctx.group));
    EXPECT_TRUE(saves[1].done()) << "save did not wait for the async_save before it";
    saves[1].wait();
    int n = 1;
    for (const std::string name : {"a", "b", "c"}) {
      ckpt::DistributedState back;
      back.sharded["w"] = ckpt::ShardedTensor{torch::zeros({4}), 4 * ctx.rank, 12};
      back.replicated["r"] = torch::zeros({1 << 16});
      ckpt::load(dir / name, back);
      EXPECT_EQ(back.metadata.at("name"), name);
      EXPECT_TRUE(torch::equal(back.sharded["w"].local, torch::arange(4, torch::kFloat) + 4 * ctx.rank + 100 * n++))
          << name << " on rank " << ctx.rank;
      EXPECT_TRUE(torch::equal(back.replicated["r"], state.replicated["r"]));
    }
  }, 60s);
  testing::expect_no_errors(errors);
}

std::string failure_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// Rank 2's file cannot be made durable: every rank's handle fails with its
// reason, and the checkpoint in the directory stays the previous one. When
// no rank waits on the handle, the next save and the next async_save throw
// the failure instead of saving (once), and the save after that works.
TEST(AsyncSave, AFailureReachesEveryRanksHandleOrElseTheNextSave) {
  testing::TempDir dir;
  const std::string failed = "checkpoint::async_save " + dir.path() + ": rank 2: cannot save tensor file";
  auto errors = run_rank_contexts(3, [&](RankContext& ctx) {
    auto writers = writer_group(ctx);
    auto value = torch::full({4}, 1.0f);
    ckpt::DistributedState state;
    state.sharded["w"] = ckpt::ShardedTensor{value, 4 * ctx.rank, 12};
    state.metadata["version"] = "1";
    ckpt::async_save(dir.path(), state, async_options(ctx, writers)).wait();
    ckpt::WriteFaults faults;
    if (ctx.rank == 2) faults.fsync_errno = EIO;
    auto failing = async_options(ctx, writers).faults(faults);
    value.fill_(2.0f);
    state.metadata["version"] = "2";
    auto pending = ckpt::async_save(dir.path(), state, failing);
    const auto seen = failure_of([&] { pending.wait(); });
    EXPECT_TRUE(testing::Contains(seen, failed));
    EXPECT_TRUE(testing::Contains(seen, "Input/output error"));
    EXPECT_TRUE(pending.done() && pending.error());
    // Unseen failures: the next async_save, then the next save, throw them.
    ckpt::async_save(dir.path(), state, failing);
    EXPECT_TRUE(testing::Contains(failure_of([&] { ckpt::async_save(dir.path(), state, async_options(ctx, writers)); }),
                                  "checkpoint::async_save " + dir.path() + ": the asynchronous save to " +
                                      dir.path() + " before it failed: " + failed));
    ckpt::async_save(dir.path(), state, failing);
    EXPECT_TRUE(testing::Contains(
        failure_of([&] { ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group)); }),
        "checkpoint::save " + dir.path() + ": the asynchronous save to " + dir.path() + " before it failed"));
    value.fill_(3.0f);
    ckpt::DistributedState back;
    back.sharded["w"] = ckpt::ShardedTensor{torch::zeros({4}), 4 * ctx.rank, 12};
    ckpt::load(dir.path(), back);
    EXPECT_EQ(back.metadata.at("version"), "1");
    EXPECT_TRUE(torch::equal(back.sharded["w"].local, torch::full({4}, 1.0f)));
    state.metadata["version"] = "3";
    ckpt::async_save(dir.path(), state, async_options(ctx, writers)).wait();
    ckpt::load(dir.path(), back);
    EXPECT_EQ(back.metadata.at("version"), "3");
    EXPECT_TRUE(torch::equal(back.sharded["w"].local, torch::full({4}, 3.0f)));
  }, 60s);
  testing::expect_no_errors(errors);
}

// Wrong writer groups and empty handles are named.
TEST(AsyncSave, WrongWriterGroupsAndEmptyHandlesAreNamed) {
  testing::TempDir dir;
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    ckpt::DistributedState state;
    state.replicated["r"] = torch::ones({2});
    auto refusal = [&](ckpt::AsyncSaveOptions options) {
      try {
        ckpt::async_save(dir.path(), state, options.process_group(ctx.group));
      } catch (const InvalidArgument& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    EXPECT_EQ(refusal(ckpt::AsyncSaveOptions().writer_group(ctx.group)),
              "checkpoint::async_save " + dir.path() +
                  ": writer_group must not be the saving group (the background writer's collectives "
                  "would interleave with the ones on the caller's thread)");
    auto self = create_process_group("tcp", std::make_shared<PrefixStore>("self" + std::to_string(ctx.rank), ctx.store),
                                     0, 1, GroupOptions().name("self"));
    EXPECT_EQ(refusal(ckpt::AsyncSaveOptions().writer_group(self)),
              "checkpoint::async_save " + dir.path() + ": writer_group has rank 0 of 1, the saving group '" +
                  ctx.group->name() + "' rank " + std::to_string(ctx.rank) +
                  " of 2: it must hold the same ranks in the same order");
    // No writer group and no default group to make one over.
    EXPECT_EQ(refusal(ckpt::AsyncSaveOptions()),
              "checkpoint::async_save needs a process group of its own beside '" + ctx.group->name() +
                  "', made over the default group's store: call dtrain::init_process_group first, or give it one");
    try {
      ckpt::AsyncSaveHandle().wait();
      ADD_FAILURE() << "an empty handle waited";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()), "AsyncSaveHandle::wait: an empty handle (not returned by async_save)");
    }
    EXPECT_FALSE(ckpt::AsyncSaveHandle().done());
  }, 30s);
  testing::expect_no_errors(errors);
}

// CUDA: a tensor written by a kernel queued on a side stream (the caller's
// current stream at the call) is staged in the background with the
// kernel's values: the writer thread's stream waits on an event recorded on
// the caller's stream at the call. Without the event its copy could run on
// the default stream before the kernel, and stage zeros. Needs a GPU (the
// GPU visit runs it); the rest of this file is its CPU side.
TEST(AsyncSave, BackgroundStagingWaitsForTheCallersStreamOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  testing::TempDir dir;
  auto errors = run_rank_contexts(1, [&](RankContext& ctx) {
    const c10::Device gpu(c10::DeviceType::CUDA, 0);
    const auto* impl = c10::impl::getDeviceGuardImpl(gpu.type());
    at::Tensor w = at::zeros({1024, 1024}, at::TensorOptions().device(gpu));
    ckpt::DistributedState state;
    state.replicated["w"] = w;
    {
      const c10::StreamGuard side(impl->getStreamFromGlobalPool(gpu));
      at::Tensor a = at::randn({4096, 4096}, at::TensorOptions().device(gpu));
      for (int i = 0; i < 8; ++i) a = a.matmul(a).div_(4096);  // tens of milliseconds queued ahead
      w.fill_(7);
      auto pending = ckpt::async_save(dir.path(), state,
                                      async_options(ctx, writer_group(ctx)).stage_in_background(true));
      pending.wait();
    }
    ckpt::DistributedState back;
    back.replicated["w"] = at::zeros({1024, 1024});
    ckpt::load(dir.path(), back);
    EXPECT_TRUE(at::equal(back.replicated["w"], at::full({1024, 1024}, 7.0f)));
  }, 60s);
  testing::expect_no_errors(errors);
}

}  // namespace
}  // namespace dtrain
