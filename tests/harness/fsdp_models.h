#pragma once

// Models with FSDP units (FullyShard<...> submodules) for the FSDP tests and
// the sharding benchmark. Outside a FullyShardedDataParallel they are plain
// modules, so the same type trains under DDP as the reference.

#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/fsdp.h"

namespace dtrain::testing {

struct LinearReluImpl : torch::nn::Module {
  LinearReluImpl(int64_t in, int64_t out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::relu(fc(x)); }
  torch::nn::Linear fc;
};

// Input [N, 10]: two units and a head the root owns.
struct ShardedMLPImpl : torch::nn::Module {
  ShardedMLPImpl() {
    l1 = register_module("l1", std::make_shared<FullyShard<LinearReluImpl>>(10, 32));
    l2 = register_module("l2", std::make_shared<FullyShard<LinearReluImpl>>(32, 32));
    head = register_module("head", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return head(l2->forward(l1->forward(x))); }
  std::shared_ptr<FullyShard<LinearReluImpl>> l1, l2;
  torch::nn::Linear head{nullptr};
};

struct ConvReluImpl : torch::nn::Module {
  ConvReluImpl(int64_t in, int64_t out)
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::relu(conv(x)); }
  torch::nn::Conv2d conv;
};

// Input [N, 1, 8, 8]: the units sit in a Sequential.
struct ShardedConvNetImpl : torch::nn::Module {
  ShardedConvNetImpl() {
    features = register_module(
        "features", torch::nn::Sequential(std::make_shared<FullyShard<ConvReluImpl>>(1, 4),
                                          std::make_shared<FullyShard<ConvReluImpl>>(4, 6)));
    fc = register_module("fc", torch::nn::Linear(6 * 8 * 8, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(features->forward(x).flatten(1)); }
  torch::nn::Sequential features{nullptr};
  torch::nn::Linear fc{nullptr};
};

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(int64_t d)
      : q(register_module("q", torch::nn::Linear(d, d))),
        // No key bias: softmax ignores it, so its gradient is rounding noise
        // that Adam would amplify.
        k(register_module("k", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)))),
        v(register_module("v", torch::nn::Linear(d, d))),
        o(register_module("o", torch::nn::Linear(d, d))),
        scale(1.0 / std::sqrt(static_cast<double>(d))) {}
  torch::Tensor forward(torch::Tensor x) {  // [N, T, d]
    auto weights = torch::softmax(torch::matmul(q(x), k(x).transpose(1, 2)) * scale, -1);
    return o(torch::matmul(weights, v(x)));
  }
  torch::nn::Linear q, k, v, o;
  double scale;
};

struct FeedForwardImpl : torch::nn::Module {
  explicit FeedForwardImpl(int64_t d)
      : fc1(register_module("fc1", torch::nn::Linear(d, 2 * d))),
        fc2(register_module("fc2", torch::nn::Linear(2 * d, d))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

// A unit with two nested units; its own parameters are the layer norms.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        attn(register_module("attn", std::make_shared<FullyShard<AttentionImpl>>(d))),
        ff(register_module("ff", std::make_shared<FullyShard<FeedForwardImpl>>(d))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn->forward(ln1(x));
    return x + ff->forward(ln2(x));
  }
  torch::nn::LayerNorm ln1, ln2;
  std::shared_ptr<FullyShard<AttentionImpl>> attn;
  std::shared_ptr<FullyShard<FeedForwardImpl>> ff;
};

// Input [N, 3, 10]: a transformer-style stack of `depth` blocks of width d.
struct BlockStackImpl : torch::nn::Module {
  explicit BlockStackImpl(int64_t depth = 2, int64_t d = 16) {
    proj = register_module("proj", torch::nn::Linear(10, d));
    for (int64_t i = 0; i < depth; ++i)
      blocks.push_back(register_module("block" + std::to_string(i),
                                       std::make_shared<FullyShard<BlockImpl>>(d)));
    head = register_module("head", torch::nn::Linear(d, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = proj(x);
    for (auto& block : blocks) x = block->forward(x);
    return head(x.mean(1));
  }
  torch::nn::Linear proj{nullptr}, head{nullptr};
  std::vector<std::shared_ptr<FullyShard<BlockImpl>>> blocks;
};

// `count` BlockStacks, each built right after torch::manual_seed(seed): the
// same values in each (on the main thread: rank threads share the
// generator).
inline std::vector<std::shared_ptr<BlockStackImpl>> seeded_stacks(int count, int seed) {
  std::vector<std::shared_ptr<BlockStackImpl>> out;
  for (int i = 0; i < count; ++i) {
    torch::manual_seed(seed);
    out.push_back(std::make_shared<BlockStackImpl>());
  }
  return out;
}

}  // namespace dtrain::testing
