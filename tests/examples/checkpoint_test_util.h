#pragma once

// Helpers of the checkpoint tests: temporary paths, bitwise snapshots of a
// model and of an Adam's state, one-rank saves and loads, and edits of a
// saved checkpoint's files (with valid checksums) to damage one entry at a
// time.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/paths.h"
#include "fashion_mnist/checkpoint.h"
#include "harness/thread_ranks.h"

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

// Runs `body` on the ranks of a thread-rank group of `world` (tcp) and
// returns each rank's error ("" when it returned).
inline std::vector<std::string> on_ranks(
    int world, const std::function<void(const std::shared_ptr<dtrain::ProcessGroup>&)>& body,
    const std::string& backend = "tcp") {
  return dtrain::testing::run_rank_contexts(
      world, [&](dtrain::testing::RankContext& ctx) { body(ctx.group); }, std::chrono::seconds(60),
      dtrain::GroupOptions(), backend);
}

// save_checkpoint by one rank; fails the test when it throws.
inline void save_alone(const std::string& dir, torch::nn::Module& model, torch::optim::Adam& opt,
                       const TrainingState& state) {
  dtrain::testing::expect_no_errors(
      on_ranks(1, [&](const auto& group) { save_checkpoint(group, dir, model, opt, state); }));
}

// load_checkpoint by one rank (a dataset of 1200); its error, or "".
inline std::string load_alone(const std::string& dir, torch::nn::Module& model,
                              torch::optim::Adam& opt, TrainingState* state = nullptr) {
  return on_ranks(1, [&](const auto& group) {
    auto loaded = load_checkpoint(group, dir, model, opt, 1200);
    if (state) *state = loaded;
  })[0];
}

// The one data file of a checkpoint saved by one rank.
inline std::string data_file(const std::string& dir) {
  for (const auto& name : dtrain::paths::list(dir))
    if (name.rfind("data-", 0) == 0) return dir + "/" + name;
  ADD_FAILURE() << "no data file in " << dir;
  return "";
}

// Rewrites a file of a checkpoint (with valid checksums), changed by `edit`.
inline void edit_file(const std::string& path,
                      const std::function<void(dtrain::checkpoint::TensorFile&)>& edit) {
  auto f = dtrain::checkpoint::load_tensor_file(path);
  edit(f);
  dtrain::checkpoint::save_tensor_file(path, f);
}
inline void edit_metadata(const std::string& dir,
                          const std::function<void(std::map<std::string, std::string>&)>& edit) {
  edit_file(dir + "/metadata.dtt", [&](auto& f) { edit(f.metadata); });
}
inline void edit_data(const std::string& dir,
                      const std::function<void(std::map<std::string, torch::Tensor>&)>& edit) {
  edit_file(data_file(dir), [&](auto& f) { edit(f.tensors); });
}

inline void remove_dir(const std::string& dir) {
  for (const auto& name : dtrain::paths::list(dir)) ::unlink((dir + "/" + name).c_str());
  ::rmdir(dir.c_str());
}

}  // namespace checkpoint_test
