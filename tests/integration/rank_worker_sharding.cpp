// rank_worker's sharded-training modes: FSDP and ZeRO-2 against one
// process training the same model on the concatenated batch.

#include <torch/torch.h>

#include <functional>
#include <iostream>

#include "dtrain/dtrain.h"
#include "harness/fsdp_models.h"
#include "integration/rank_worker.h"

namespace {

// 10 steps of `forward` on this rank's part of each batch with `opt`, and
// of `reference` (one process, Adam at the same lr) on the whole batch.
void train_beside_reference(int rank, int world,
                            const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                            torch::optim::Optimizer& opt, dtrain::testing::BlockStackImpl& reference) {
  torch::optim::Adam ref_opt(reference.parameters(), torch::optim::AdamOptions(1e-3));
  for (int step = 0; step < 10; ++step) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(100 + step * world + r);
      xs.push_back(torch::randn({4, 3, 10}));
      ys.push_back(torch::randn({4, 4}));
    }
    opt.zero_grad();
    torch::mse_loss(forward(xs[rank]), ys[rank]).backward();
    opt.step();
    ref_opt.zero_grad();
    torch::mse_loss(reference.forward(torch::cat(xs)), torch::cat(ys)).backward();
    ref_opt.step();
  }
}

}  // namespace

// FullyShardedDataParallel (nested attention units, Adam) against one
// process training the same model on the concatenated batch.
// With sharded_construction each rank builds its model under a
// ShardedConstruction from a seed of its own: rank 0's values must win.
int fsdp_equivalence(const std::string& backend, bool sharded_construction) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  auto make = [](int seed) {
    torch::manual_seed(seed);
    return std::make_shared<dtrain::testing::BlockStackImpl>();
  };
  auto reference = make(0);
  std::shared_ptr<dtrain::testing::BlockStackImpl> model;
  if (sharded_construction) {
    dtrain::ShardedConstruction sharded;
    model = make(rank);
    for (const auto& block : model->blocks)
      for (const auto& p : block->parameters())
        if (p.storage().nbytes() != 0) return fail("a unit kept its parameters after construction");
  } else {
    model = make(0);
  }
  dtrain::FullyShardedDataParallel fsdp(model);
  // lr 1e-3: fsdp_test.cpp's kTransformerAdam says why.
  torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(1e-3));
  train_beside_reference(rank, world, [&](const torch::Tensor& x) { return fsdp.forward(x); }, opt,
                         *reference);
  const auto full = fsdp.full_state_dict();
  for (const auto& item : reference->named_parameters())
    if (!torch::allclose(full.at(item.key()), item.value(), 1e-5, 1e-6))
      return fail("parameter " + item.key() + " differs from single-process training");
  const auto stats = fsdp.stats();
  std::cout << "rank " << rank << (sharded_construction ? " fsdp (sharded construction)" : " fsdp")
            << " matches single-process training on "
            << dtrain::default_group()->backend_name() << " keeping " << stats.shard_bytes
            << " shard bytes" << std::endl;
  dtrain::destroy_process_group();
  return 0;
}

// ZeroRedundancyOptimizer (Adam) under DDP against one process on the
// combined batch: ZeRO-1 (a plain DDP) or ZeRO-2 (DDP with shard_gradients,
// small buckets: several slices per rank).
int zero_equivalence(const std::string& backend, int stage) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  auto make = [] {
    torch::manual_seed(0);
    return std::make_shared<dtrain::testing::BlockStackImpl>();
  };
  auto reference = make();
  auto model = make();
  dtrain::DistributedDataParallel ddp(
      model, dtrain::DDPOptions().shard_gradients(stage == 2).bucket_cap_mb(0.002));
  auto adam = [](std::vector<torch::Tensor> shard) {
    return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
  };
  auto opt = stage == 2 ? std::make_unique<dtrain::ZeroRedundancyOptimizer>(ddp, adam)
                        : std::make_unique<dtrain::ZeroRedundancyOptimizer>(ddp.parameters(), adam);
  train_beside_reference(rank, world, [&](const torch::Tensor& x) { return ddp.forward(x); }, *opt,
                         *reference);
  const auto want = reference->named_parameters();
  for (const auto& item : model->named_parameters())
    if (!torch::allclose(item.value(), want[item.key()], 1e-5, 1e-6))
      return fail("parameter " + item.key() + " differs from single-process training");
  int64_t shares = 0;
  for (const auto& shard : opt->local_optimizer().param_groups()[0].params()) shares += shard.numel();
  std::cout << "rank " << rank << " zero" << stage << " matches single-process training on "
            << dtrain::default_group()->backend_name() << " stepping " << shares << " of "
            << opt->numel() << " elements"
            << std::endl;
  dtrain::destroy_process_group();
  return 0;
}
