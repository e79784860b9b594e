// rank_worker's sharded-training modes: FSDP, ZeRO-1/2 and SyncBatchNorm
// under DDP against one process training the same model on the
// concatenated batch, on the CPU or on a GPU.

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
                            torch::optim::Optimizer& opt, dtrain::testing::BlockStackImpl& reference,
                            torch::Device device) {
  torch::optim::Adam ref_opt(reference.parameters(), torch::optim::AdamOptions(1e-3));
  for (int step = 0; step < 10; ++step) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(100 + step * world + r);
      xs.push_back(torch::randn({4, 3, 10}));
      ys.push_back(torch::randn({4, 4}));
    }
    opt.zero_grad();
    torch::mse_loss(forward(xs[rank].to(device)), ys[rank].to(device)).backward();
    opt.step();
    ref_opt.zero_grad();
    torch::mse_loss(reference.forward(torch::cat(xs).to(device)), torch::cat(ys).to(device)).backward();
    ref_opt.step();
  }
}

}  // namespace

// FullyShardedDataParallel (nested attention units, Adam) against one
// process training the same model on the concatenated batch.
// With kShardedConstruction each rank builds its model under a
// ShardedConstruction from a seed of its own: rank 0's values must win.
// With kHybrid the ranks are 2 replicas of world / 2 shards (HSDP).
int fsdp_equivalence(const std::string& backend, FsdpVariant variant, torch::Device device) {
  const bool sharded_construction = variant == FsdpVariant::kShardedConstruction;
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
  reference->to(device);
  if (!sharded_construction) model->to(device);
  dtrain::FSDPOptions options;
  if (variant == FsdpVariant::kHybrid) {
    if (world % 2 != 0) return fail("hsdp needs an even number of ranks");
    options.mesh(dtrain::init_device_mesh({2, world / 2}, {"replicate", "shard"}));
  }
  dtrain::FullyShardedDataParallel fsdp(model, options);
  // lr 1e-3: fsdp_test.cpp's kTransformerAdam says why.
  torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(1e-3));
  train_beside_reference(rank, world, [&](const torch::Tensor& x) { return fsdp.forward(x); }, opt,
                         *reference, device);
  const auto full = fsdp.full_state_dict();
  for (const auto& item : reference->named_parameters())
    if (!torch::allclose(full.at(item.key()).cpu(), item.value().cpu(), 1e-5, 1e-6))
      return fail("parameter " + item.key() + " differs from single-process training");
  const auto stats = fsdp.stats();
  const char* what = sharded_construction ? " fsdp (sharded construction)"
                     : variant == FsdpVariant::kHybrid ? " hsdp (2 replicas)"
                                                       : " fsdp";
  std::cout << "rank " << rank << what
            << " matches single-process training on "
            << dtrain::default_group()->backend_name() << " with tensors on " << device << " keeping " << stats.shard_bytes
            << " shard bytes" << std::endl;
  dtrain::destroy_process_group();
  return 0;
}

// ZeroRedundancyOptimizer (Adam) under DDP against one process on the
// combined batch: ZeRO-1 (a plain DDP) or ZeRO-2 (DDP with shard_gradients,
// small buckets: several slices per rank).
int zero_equivalence(const std::string& backend, int stage, torch::Device device) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  auto make = [] {
    torch::manual_seed(0);
    return std::make_shared<dtrain::testing::BlockStackImpl>();
  };
  auto reference = make();
  auto model = make();
  reference->to(device);
  model->to(device);
  dtrain::DistributedDataParallel ddp(
      model, dtrain::DDPOptions().shard_gradients(stage == 2).bucket_cap_mb(0.002));
  auto adam = [](std::vector<torch::Tensor> shard) {
    return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
  };
  auto opt = stage == 2 ? std::make_unique<dtrain::ZeroRedundancyOptimizer>(ddp, adam)
                        : std::make_unique<dtrain::ZeroRedundancyOptimizer>(ddp.parameters(), adam);
  train_beside_reference(rank, world, [&](const torch::Tensor& x) { return ddp.forward(x); }, *opt,
                         *reference, device);
  const auto want = reference->named_parameters();
  for (const auto& item : model->named_parameters())
    if (!torch::allclose(item.value().cpu(), want[item.key()].cpu(), 1e-5, 1e-6))
      return fail("parameter " + item.key() + " differs from single-process training");
  int64_t shares = 0;
  for (const auto& shard : opt->local_optimizer().param_groups()[0].params()) shares += shard.numel();
  std::cout << "rank " << rank << " zero" << stage << " matches single-process training on "
            << dtrain::default_group()->backend_name() << " with tensors on " << device << " stepping " << shares << " of "
            << opt->numel() << " elements"
            << std::endl;
  dtrain::destroy_process_group();
  return 0;
}

// SyncBatchNorm2d inside DDP against one process with BatchNorm2d on the
// whole batch: parameters and running statistics after 10 SGD steps.
int syncbn_equivalence(const std::string& backend, torch::Device device) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  auto convnet = [](torch::nn::AnyModule norm) {
    torch::manual_seed(7);
    torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3)));
    net->push_back(std::move(norm));
    net->push_back(torch::nn::ReLU());
    net->push_back(torch::nn::Flatten());
    net->push_back(torch::nn::Linear(36, 3));
    return net;
  };
  auto single = convnet(torch::nn::AnyModule(torch::nn::BatchNorm2d(4)));
  auto net = convnet(torch::nn::AnyModule(dtrain::SyncBatchNorm2d(torch::nn::BatchNormOptions(4))));
  single->to(device);
  net->to(device);
  dtrain::DistributedDataParallel ddp(net.ptr());
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD single_opt(single->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  constexpr int kBatch = 4;
  for (int step = 0; step < 10; ++step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({world * kBatch, 2, 5, 5}).to(device);
    const auto y = torch::randn({world * kBatch, 3}).to(device);
    opt.zero_grad();
    torch::mse_loss(ddp.forward(x.narrow(0, rank * kBatch, kBatch)), y.narrow(0, rank * kBatch, kBatch))
        .backward();
    opt.step();
    single_opt.zero_grad();
    torch::mse_loss(single->forward(x), y).backward();
    single_opt.step();
  }
  auto want = single->named_parameters();
  for (const auto& p : net->named_parameters())
    if (!torch::allclose(p.value().cpu(), want[p.key()].cpu(), 1e-5, 1e-6))
      return fail("parameter " + p.key() + " differs from single-process BatchNorm training");
  auto want_buffers = single->named_buffers();
  for (const auto& b : net->named_buffers())
    if (!torch::allclose(b.value().cpu().to(torch::kDouble), want_buffers[b.key()].cpu().to(torch::kDouble),
                         1e-5, 1e-6))
      return fail("buffer " + b.key() + " differs from single-process BatchNorm training");
  std::cout << "rank " << rank << " syncbn matches single-process training on "
            << dtrain::default_group()->backend_name() << " with tensors on " << device << std::endl;
  dtrain::destroy_process_group();
  return 0;
}
