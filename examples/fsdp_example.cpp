// Sharded training with FullyShardedDataParallel: each block is a unit
// whose full parameters exist only while it computes (and, built under a
// ShardedConstruction, only while it is constructed). Run it with
//   dtrain-run --standalone --nproc-per-node 2 ./fsdp_example
#include <dtrain/dtrain.h>
#include <torch/torch.h>

#include <iostream>

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc{register_module("fc", torch::nn::Linear(256, 256))};
  torch::Tensor forward(torch::Tensor x) { return x + torch::relu(fc(x)); }
};

struct Net : torch::nn::Module {
  std::vector<std::shared_ptr<dtrain::FullyShard<BlockImpl>>> blocks;  // the units
  torch::nn::Linear head{register_module("head", torch::nn::Linear(256, 10))};
  Net() {
    for (int i = 0; i < 4; ++i)
      blocks.push_back(register_module("block" + std::to_string(i),
                                       std::make_shared<dtrain::FullyShard<BlockImpl>>()));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : blocks) x = block->forward(x);  // gather, compute, free
    return torch::log_softmax(head(x), 1);
  }
};

int main() {
  dtrain::init_process_group();
  torch::manual_seed(dtrain::get_rank());
  std::shared_ptr<Net> net;
  {
    dtrain::ShardedConstruction sharded;  // each block sharded as it is built
    net = std::make_shared<Net>();
  }
  dtrain::FullyShardedDataParallel fsdp(net);  // rank 0's values, sharded
  torch::optim::Adam opt(fsdp.parameters(), 1e-3);  // steps on this rank's shards
  auto x = torch::randn({32, 256}), y = torch::randint(0, 10, {32});
  float first = 0, loss_value = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    auto loss = torch::nll_loss(fsdp.forward(x), y);
    loss.backward();  // gradients reduce-scattered into the shards
    opt.step();
    loss_value = loss.item<float>();
    if (step == 0) first = loss_value;
  }
  if (loss_value >= first) {
    std::cerr << "rank " << dtrain::get_rank() << ": the loss did not fall" << std::endl;
    return 1;
  }
  if (dtrain::get_rank() == 0)
    std::cout << "loss " << first << " -> " << loss_value << ", this rank keeps "
              << fsdp.stats().shard_bytes << " of the model's bytes" << std::endl;
  dtrain::destroy_process_group();
}
