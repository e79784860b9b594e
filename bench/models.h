#pragma once

// Models the benchmarks train.

#include <torch/torch.h>

#include <array>

#include "dtrain/fsdp.h"
#include "dtrain/nn/sync_batch_norm.h"

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

// A small ResNet-style convnet for 3x32x32 images: a stem convolution and
// `blocks` residual blocks (conv-norm-relu-conv-norm plus the input), each
// norm a torch::nn::BatchNorm2d or, with `sync`, a dtrain::SyncBatchNorm2d.
struct ResNetImpl : torch::nn::Module {
  ResNetImpl(int blocks, int width, bool sync) {
    auto norm = [&](const std::string& name) {
      torch::nn::BatchNormOptions o(width);
      auto m = sync ? torch::nn::AnyModule(dtrain::SyncBatchNorm2d(o))
                    : torch::nn::AnyModule(torch::nn::BatchNorm2d(o));
      register_module(name, m.ptr());
      return m;
    };
    auto conv = [&](const std::string& name, int in) {
      return register_module(name, torch::nn::Conv2d(torch::nn::Conv2dOptions(in, width, 3).padding(1)));
    };
    stem = conv("stem", 3);
    stem_norm = norm("stem_norm");
    for (int b = 0; b < blocks; ++b) {
      const auto id = std::to_string(b);
      convs.push_back({conv("conv" + id + "a", width), conv("conv" + id + "b", width)});
      norms.push_back({norm("norm" + id + "a"), norm("norm" + id + "b")});
    }
    fc = register_module("fc", torch::nn::Linear(width, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(stem_norm.forward(stem(x)));
    for (size_t b = 0; b < convs.size(); ++b) {
      auto h = torch::relu(norms[b][0].forward(convs[b][0](x)));
      x = torch::relu(x + norms[b][1].forward(convs[b][1](h)));
    }
    return torch::log_softmax(fc(x.mean({2, 3})), 1);
  }
  torch::nn::Conv2d stem{nullptr};
  torch::nn::AnyModule stem_norm;
  std::vector<std::array<torch::nn::Conv2d, 2>> convs;
  std::vector<std::array<torch::nn::AnyModule, 2>> norms;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

struct WideLayerImpl : torch::nn::Module {
  explicit WideLayerImpl(int width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::relu(fc(x)); }
  torch::nn::Linear fc;
};

// `layers` square layers of `width`, each an FSDP unit (a plain module
// outside FullyShardedDataParallel), and a 10-way head the root owns.
struct WideMlpImpl : torch::nn::Module {
  WideMlpImpl(int layers, int width) {
    for (int i = 0; i < layers; ++i)
      blocks.push_back(register_module("layer" + std::to_string(i),
                                       std::make_shared<dtrain::FullyShard<WideLayerImpl>>(width)));
    head = register_module("head", torch::nn::Linear(width, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b->forward(x);
    return torch::log_softmax(head(x), 1);
  }
  std::vector<std::shared_ptr<dtrain::FullyShard<WideLayerImpl>>> blocks;
  torch::nn::Linear head{nullptr};
};

}  // namespace dtrain::bench
