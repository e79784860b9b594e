// A storage written as one file against the checkpoint subsystem's storage
// interface (src/checkpoint/storage/storage.h; docs/design/checkpoint-
// storage.md shows the same one): every rank's part kept in this process's
// memory, committed once every rank's part is in. Saved through the
// group's Checkpointer, on the caller's thread and in the background, it
// gets what every storage gets: the state as it was at the call, a failure
// on one rank on every rank, the previous save kept.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "checkpoint/checkpointer.h"
#include "checkpoint/storage/storage.h"
#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
namespace ckpt = checkpoint;
namespace storage = checkpoint::storage;

// ---- the storage: one class for writing, one for reading --------------------

struct Memory {
  std::mutex mutex;
  std::map<int, storage::Part> writing, committed;  // by rank
};

class MemoryWriter final : public storage::Writer {
 public:
  MemoryWriter(Memory& memory, std::string fail_on_rank = "")
      : memory_(memory), context_("memory storage"), fail_(std::move(fail_on_rank)) {}
  const std::string& context() const override { return context_; }
  const char* lane() const override { return "memory"; }

  storage::Written write(const storage::Part& part, const storage::SavePlan&,
                         const std::shared_ptr<ProcessGroup>& group, const std::string& prior) override {
    std::string error = prior;
    if (error.empty() && fail_ == std::to_string(group->rank())) error = "no room";
    if (error.empty()) {
      storage::Part copy = part;  // the storage's own copy: part's tensors are the caller's
      for (auto& [name, t] : copy.replicated) t = t.clone();
      for (auto& [name, s] : copy.sharded) s.local = s.local.clone();
      std::lock_guard<std::mutex> lock(memory_.mutex);
      memory_.writing[group->rank()] = std::move(copy);
    }
    agree(*group, error);  // every rank's part is in, or every rank throws
    std::lock_guard<std::mutex> lock(memory_.mutex);
    memory_.committed[group->rank()] = memory_.writing.at(group->rank());
    return storage::Written{};
  }

 private:
  void agree(ProcessGroup& group, const std::string& error) {
    try {
      fail_together(group, error);
    } catch (const Error& e) {
      throw Error(context_ + ": " + e.what());
    }
  }
  Memory& memory_;
  std::string context_, fail_;
};

class MemoryReader final : public storage::Reader {
 public:
  MemoryReader(Memory& memory, int rank) : memory_(memory), rank_(rank) {}
  std::optional<storage::Loaded> read(const ckpt::DistributedState& state) override {
    std::lock_guard<std::mutex> lock(memory_.mutex);
    auto it = memory_.committed.find(rank_);
    if (it == memory_.committed.end()) return std::nullopt;
    storage::Loaded out;
    for (const auto& [name, t] : state.replicated)
      if (it->second.replicated.count(name)) out.fills.emplace_back(t, it->second.replicated.at(name));
    for (const auto& [name, s] : state.sharded) out.fills.emplace_back(s.local, it->second.sharded.at(name).local);
    out.metadata = it->second.metadata;
    return out;
  }

 private:
  Memory& memory_;
  int rank_;
};

// ---- the test ---------------------------------------------------------------

// A state built once: a replicated tensor (written by the plan's owner
// only) and each rank's disjoint piece of a sharded one.
struct Trained {
  at::Tensor weights = torch::zeros({4});
  at::Tensor piece = torch::zeros({3});
  ckpt::DistributedState state;

  explicit Trained(int rank) {
    state.replicated["weights"] = weights;
    state.sharded["moments"] = ckpt::ShardedTensor{piece, 3 * rank, 6};
  }
  void step(float value) {
    weights.fill_(value);
    piece.fill_(value + 0.5f);
    state.metadata["step"] = std::to_string(value);
  }
};

TEST(CheckpointStorage, AStorageOfOneFileSavesInTheBackgroundTheStateOfTheCallAndFailsEverywhere) {
  Memory memory;
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
    auto companion = create_process_group("tcp", std::make_shared<PrefixStore>("memory", ctx.store), ctx.rank,
                                          ctx.world, GroupOptions().name("memory").timeout(20s));
    auto checkpointer = ckpt::Checkpointer::of(ctx.group);
    Trained t(ctx.rank);
    t.step(1);
    MemoryWriter sync(memory);
    checkpointer->save(sync, t.state);
    // In the background: the state changes at once, the storage gets the call's.
    t.step(2);
    auto job = std::make_shared<ckpt::BackgroundJob>();
    job->described = "the memory save of step 2";
    ckpt::BackgroundOptions options;
    options.companion = companion;
    checkpointer->save_in_background(std::make_unique<MemoryWriter>(memory), t.state, job, options);
    t.step(3);
    EXPECT_EQ(job->outcome(true), nullptr);
    // One rank's failure is every rank's, and the save before stays.
    t.step(4);
    MemoryWriter failing(memory, "1");
    EXPECT_EQ(testing::what_thrown<Error>([&] { checkpointer->save(failing, t.state); }),
              "memory storage: rank 1: no room");
    Trained back(ctx.rank);
    MemoryReader reader(memory, ctx.rank);
    ASSERT_TRUE(ckpt::load_state(reader, back.state));
    EXPECT_EQ(back.state.metadata.at("step"), std::to_string(2.0f));
    EXPECT_TRUE(at::equal(back.piece, torch::full({3}, 2.5f)));
    // The replicated entry is in its owner's part only; that rank's state has it.
    if (memory.committed.at(ctx.rank).replicated.count("weights"))
      EXPECT_TRUE(at::equal(back.weights, torch::full({4}, 2.0f)));
  }, 60s));
  int owners = 0;
  for (const auto& [rank, part] : memory.committed) owners += part.replicated.count("weights");
  EXPECT_EQ(owners, 1) << "the plan writes a replicated entry once";
}

}  // namespace
}  // namespace dtrain
