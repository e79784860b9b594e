#pragma once

// Models the benchmarks train.

#include <torch/torch.h>

namespace dtrain::bench {

// The classic MNIST convnet (the same as ../shared/baselines/py_ddp_train.py):
// conv 1->32->64, max-pool, fc 9216->128->10, log-softmax.
// Cloneable, so DataParallel can replicate it: the layers are made in reset().
struct MnistNetImpl : torch::nn::Cloneable<MnistNetImpl> {
  MnistNetImpl() { reset(); }
  void reset() override {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)));
    fc1 = register_module("fc1", torch::nn::Linear(9216, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv1(x));
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = torch::relu(fc1(torch::flatten(x, 1)));
    return torch::log_softmax(fc2(x), 1);
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MnistNet);

// A deep MLP whose gradient traffic is comparable to its compute.
struct DeepMlpImpl : torch::nn::Module {
  DeepMlpImpl(int layers, int width) {
    for (int i = 0; i < layers; ++i)
      stack->push_back(torch::nn::Linear(width, width)), stack->push_back(torch::nn::ReLU());
    register_module("stack", stack);
  }
  torch::Tensor forward(torch::Tensor x) { return stack->forward(x); }
  torch::nn::Sequential stack;
};
TORCH_MODULE(DeepMlp);

}  // namespace dtrain::bench
