// The DistributedDataParallel example from README.md, compiled so that it stays true.
#include <dtrain/dtrain.h>
#include <torch/torch.h>

#include <iostream>

struct Net : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(784, 128))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(128, 10))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};

int main() {
  dtrain::init_process_group();                         // env://, as torchrun sets it
  torch::manual_seed(dtrain::get_rank());               // each rank draws its own data
  dtrain::DistributedDataParallel ddp(std::make_shared<Net>());  // rank 0's weights everywhere
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto x = torch::randn({32, 784}), y = torch::randint(0, 10, {32});
  for (int step = 0; step < 50; ++step) {
    opt.zero_grad();
    auto loss = torch::nll_loss(torch::log_softmax(ddp.forward(x), 1), y);
    loss.backward();                                    // averaged across ranks, during backward
    opt.step();
    if (dtrain::get_rank() == 0 && step % 10 == 0)
      std::cout << "step " << step << " loss " << loss.item<float>() << std::endl;
  }
  dtrain::destroy_process_group();
}
