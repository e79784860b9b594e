#pragma once

// Small models for the DDP and DataParallel tests, each with a
// forward(Tensor). Those DataParallel replicates are Cloneable: everything is
// created in reset().

#include <torch/torch.h>

namespace dtrain::testing {

struct MLPImpl : torch::nn::Cloneable<MLPImpl> {
  MLPImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(10, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MLP);

// Input: [N, 1, 8, 8].
struct ConvNetImpl : torch::nn::Cloneable<ConvNetImpl> {
  ConvNetImpl() { reset(); }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    fc = register_module("fc", torch::nn::Linear(4 * 6 * 6, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc(torch::relu(conv(x.view({-1, 1, 8, 8}))).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvNet);

// Buffers: a constant scale (broadcast from rank 0 at construction) and a
// forward counter that changes every step (broadcast before each forward).
struct BufferNetImpl : torch::nn::Module {
  BufferNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(10, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    scale = register_buffer("scale", torch::rand({16}) + 0.5);
    calls = register_buffer("calls", torch::zeros({1}, torch::kLong));
  }
  torch::Tensor forward(torch::Tensor x) {
    {
      torch::NoGradGuard no_grad;
      calls.add_(1);
    }
    return fc2(torch::tanh(fc1(x)) * scale);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor scale, calls;
};
TORCH_MODULE(BufferNet);

// `unused` never takes part in forward.
struct UnusedNetImpl : torch::nn::Module {
  UnusedNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(10, 16));
    unused = register_module("unused", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, unused{nullptr}, fc2{nullptr};
};
TORCH_MODULE(UnusedNet);


// Batch-dependent in training mode; buffers: running mean/var, batch count.
struct BatchNormNetImpl : torch::nn::Cloneable<BatchNormNetImpl> {
  BatchNormNetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(10, 16));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(BatchNormNet);

}  // namespace dtrain::testing
