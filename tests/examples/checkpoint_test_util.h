#pragma once

// Helpers of the checkpoint tests: temporary paths, bitwise snapshots of a
// model and of an Adam's state, and checkpoint files crafted part by part
// (the layout save_checkpoint writes) to damage one part at a time.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

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
      auto it = opt.state().find(c10::guts::to_string(p.unsafeGetTensorImpl()));
      if (it == opt.state().end()) {
        s.steps.push_back(-1);
        continue;
      }
      auto& st = static_cast<torch::optim::AdamParamState&>(*it->second);
      s.steps.push_back(st.step());
      s.tensors.push_back(st.exp_avg().clone());
      s.tensors.push_back(st.exp_avg_sq().clone());
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

// What save_checkpoint stores as "signature": names and shapes.
inline std::string signature(torch::nn::Module& model) {
  std::ostringstream out;
  for (const auto& p : model.named_parameters()) out << p.key() << ":" << p.value().sizes() << ";";
  for (const auto& b : model.named_buffers()) out << b.key() << ":" << b.value().sizes() << ";";
  return out.str();
}

// The counters and the RNG state of a valid checkpoint (epoch 1, step 2 of it).
inline std::map<std::string, torch::Tensor> good_entries() {
  auto counter = [](int64_t v) { return torch::tensor({v}, torch::kLong); };
  return {{"epoch", counter(1)},
          {"step_in_epoch", counter(2)},
          {"global_step", counter(21)},
          {"world_size", counter(1)},
          {"rng", at::detail::getDefaultCPUGenerator().get_state()}};
}

// A checkpoint file of the layout save_checkpoint writes, from these parts.
inline void write_parts(const std::string& path, torch::nn::Module& model_part,
                        torch::optim::Optimizer& optimizer_part, const std::string& signature,
                        const std::map<std::string, torch::Tensor>& entries) {
  torch::serialize::OutputArchive archive, model_archive, opt_archive;
  model_part.save(model_archive);
  optimizer_part.save(opt_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", opt_archive);
  archive.write("signature", c10::IValue(signature));
  for (const auto& [key, value] : entries) archive.write(key, value);
  archive.save_to(path);
}

}  // namespace checkpoint_test
