// HSDP: FullyShardedDataParallel over a 2-D mesh (replicate x shard) trains
// as DDP over all its ranks does, starts from rank 0's parameters whatever
// each rank built, keeps half the model per rank on a 2 x 2 mesh, and names
// a mesh it cannot use.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/fsdp_models.h"
#include "harness/thread_ranks.h"
#include "harness/training.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
using testing::run_rank_contexts;
using testing::thread_mesh;

constexpr int kHsdpBatch = 4, kHsdpSteps = 6;

// Replicas (dimension 0) x shards (dimension 1) over 4 thread ranks,
// against DDP over the 4; each rank builds its models from its own seed,
// so only the broadcasts make them rank 0's.
void expect_hsdp_equals_ddp(const testing::MakeOptimizer& make, const std::string& backend) {
  SCOPED_TRACE(backend);
  constexpr int kWorld = 4;
  torch::manual_seed(7);
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int s = 0; s < kHsdpSteps; ++s)
    data.emplace_back(torch::randn({kWorld * kHsdpBatch, 3, 10}), torch::randn({kWorld * kHsdpBatch, 4}));
  std::vector<std::shared_ptr<testing::BlockStackImpl>> plain, sharded;
  for (int r = 0; r < kWorld; ++r) {
    torch::manual_seed(r);
    plain.push_back(std::make_shared<testing::BlockStackImpl>());
    torch::manual_seed(r == 0 ? 0 : 100 + r);  // rank 0's model is DDP's rank 0's
    sharded.push_back(std::make_shared<testing::BlockStackImpl>());
  }
  testing::expect_no_errors(run_rank_contexts(kWorld, [&](RankContext& ctx) {
    const int r = ctx.rank;
    DistributedDataParallel ddp(plain[r], DDPOptions().process_group(ctx.group));
    auto mesh = DeviceMesh({2, 2}, {"replicate", "shard"}, thread_mesh(ctx, backend));
    FullyShardedDataParallel hsdp(sharded[r], FSDPOptions().mesh(mesh));
    EXPECT_EQ(&hsdp.process_group(), mesh.get_group("shard").get());
    auto opt_ddp = make(ddp.parameters());
    auto opt_hsdp = make(hsdp.parameters());
    for (const auto& [x, y] : data) {
      auto mine = [&](const at::Tensor& t) { return t.narrow(0, r * kHsdpBatch, kHsdpBatch); };
      opt_ddp->zero_grad();
      torch::mse_loss(ddp.forward(mine(x)), mine(y)).backward();
      opt_ddp->step();
      opt_hsdp->zero_grad();
      torch::mse_loss(hsdp.forward(mine(x)), mine(y)).backward();
      opt_hsdp->step();
    }
    const auto full = hsdp.full_state_dict();
    size_t compared = 0;
    for (const auto& item : plain[r]->named_parameters()) {
      const auto& want = item.value();
      const auto& got = full.at(item.key());
      EXPECT_LE((got - want).abs().max().item<double>(), 1e-5 * want.abs().max().item<double>() + 1e-7)
          << "rank " << r << " '" << item.key() << "'";
      ++compared;
    }
    EXPECT_EQ(compared, full.size());
    // Half of each unit per rank (the shard dimension's size is 2), the
    // same half as the other replica's rank at this shard coordinate.
    const auto replicas = mesh.get_group("replicate");
    for (const auto& shard : hsdp.shard_layout()) {
      EXPECT_EQ(shard.shard.numel(), (shard.numel + 1) / 2) << shard.unit;
      EXPECT_EQ(shard.offset, mesh.get_local_rank("shard") * shard.shard.numel()) << shard.unit;
      auto low = shard.shard.detach().clone(), high = low.clone();
      replicas->all_reduce(low, ReduceOp::MIN)->wait();
      replicas->all_reduce(high, ReduceOp::MAX)->wait();
      EXPECT_TRUE(low.equal(high)) << "replicas differ in unit " << shard.unit;
    }
    // rank0_only: the whole mesh's rank 0, not each replica's.
    EXPECT_EQ(hsdp.full_state_dict(/*rank0_only=*/true).empty(), r != 0);
  }, 120s));
}

TEST(Hsdp, TwoReplicasOfTwoShardsEqualDdpOverFourRanks) {
  // Adam over attention blocks with nested units; SGD with momentum on shm.
  const testing::MakeOptimizer adam = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3));
  };
  expect_hsdp_equals_ddp(adam, "tcp");
  expect_hsdp_equals_ddp(testing::kSgdMomentum, "shm");
}

TEST(Hsdp, AMeshItCannotUseIsNamed) {
  testing::expect_no_errors(run_rank_contexts(4, [&](RankContext& ctx) {
    auto mesh = DeviceMesh({2, 2, 1}, {"a", "b", "c"}, thread_mesh(ctx));
    torch::manual_seed(0);
    auto model = std::make_shared<testing::ShardedMLPImpl>();
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                FullyShardedDataParallel fsdp(model, FSDPOptions().mesh(mesh));
              }),
              "FullyShardedDataParallel: a mesh of 2 x 2 x 1 has 3 dimensions; FSDP takes 1 "
              "(shard) or 2 (replicate, shard: HSDP); slice it first "
              "(mesh[{\"dp_replicate\", \"dp_shard\"}])");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                FullyShardedDataParallel fsdp(
                    model, FSDPOptions().mesh(mesh[{"a", "b"}]).process_group(ctx.group));
              }),
              "FullyShardedDataParallel: give FSDPOptions a process_group or a mesh, not both");
    // A 1-D mesh is plain FSDP over its group.
    FullyShardedDataParallel fsdp(model, FSDPOptions().mesh(mesh["b"]));
    EXPECT_EQ(&fsdp.process_group(), mesh.get_group("b").get());
    EXPECT_EQ(fsdp.engine().replicate_group(), nullptr);
  }));
}

}  // namespace
}  // namespace dtrain
