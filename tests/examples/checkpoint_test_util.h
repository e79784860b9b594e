#pragma once

// Helpers of the checkpoint tests: temporary paths, bitwise snapshots of a
// model and of an Adam's state, and checkpoint files crafted entry by entry
// (what save_checkpoint writes) to damage one entry at a time.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fashion_mnist/checkpoint.h"

namespace checkpoint_test {

inline std::string temp_path(const std::string& name) {
  return "/tmp/dtrain-ckpt-" + std::to_string(getpid()) + "-" + name;
}

inline std::vector<torch::Tensor> copy_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

inline bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// Bit for bit: same dtypes, shapes and bytes.
inline void expect_unchanged(torch::nn::Module& m, const std::vector<torch::Tensor>& before) {
  auto now = m.parameters();
  ASSERT_EQ(now.size(), before.size());
  for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(same_bits(now[i], before[i])) << "parameter " << i;
}

// One training step on random data, so the optimizer has a state.
inline void step(torch::nn::Module& m, torch::optim::Optimizer& opt) {
  opt.zero_grad();
  torch::Tensor loss = torch::zeros({});
  for (auto& p : m.parameters()) loss = loss + (p * torch::randn_like(p)).sum();
  loss.backward();
  opt.step();
}

// Each parameter's Adam state, in parameter order: step, exp_avg, exp_avg_sq.
struct AdamSnapshot {
  std::vector<int64_t> steps;
  std::vector<torch::Tensor> tensors;
};

inline AdamSnapshot snapshot(torch::optim::Adam& opt) {
  AdamSnapshot s;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      const auto* st = adam_state(opt, p);
      if (st == nullptr) {
        s.steps.push_back(-1);
        continue;
      }
      s.steps.push_back(st->step());
      s.tensors.push_back(st->exp_avg().clone());
      s.tensors.push_back(st->exp_avg_sq().clone());
    }
  }
  return s;
}

inline void expect_unchanged(torch::optim::Adam& opt, const AdamSnapshot& before) {
  auto now = snapshot(opt);
  EXPECT_EQ(now.steps, before.steps);
  ASSERT_EQ(now.tensors.size(), before.tensors.size());
  for (size_t i = 0; i < now.tensors.size(); ++i)
    EXPECT_TRUE(same_bits(now.tensors[i], before.tensors[i])) << "optimizer tensor " << i;
}

// What save_checkpoint writes for `model` and `opt` (epoch 1, step 2 of
// it), to be damaged one entry at a time and written with write_contents.
inline dtrain::checkpoint::TensorFile good_contents(torch::nn::Module& model,
                                                   const torch::optim::Adam& opt) {
  return checkpoint_contents(model, opt, TrainingState{1, 2, 21, 1});
}

inline void write_contents(const std::string& path, const dtrain::checkpoint::TensorFile& f) {
  dtrain::checkpoint::save_tensor_file(path, f);
}

}  // namespace checkpoint_test
