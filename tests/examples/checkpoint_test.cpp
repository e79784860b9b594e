// The training example's checkpoints: a checkpoint of another model, or a
// damaged file, is refused with a message naming the file, and the model and
// optimizer are left exactly as they were.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <fstream>

#include "fashion_mnist/checkpoint.h"
#include "fashion_mnist/model.h"
#include "harness/assertions.h"

namespace {

using dtrain::testing::Contains;

struct OtherImpl : torch::nn::Module {
  OtherImpl() { fc = register_module("fc", torch::nn::Linear(4, 2)); }
  torch::nn::Linear fc{nullptr};
};

std::string temp_path(const char* name) {
  return std::string("/tmp/dtrain-ckpt-") + std::to_string(getpid()) + "-" + name;
}

std::vector<torch::Tensor> copy_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_unchanged(torch::nn::Module& m, const std::vector<torch::Tensor>& before) {
  auto now = m.parameters();
  ASSERT_EQ(now.size(), before.size());
  for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(torch::equal(now[i], before[i])) << i;
}

TEST(Checkpoint, RoundTripRestoresModelOptimizerAndPosition) {
  const auto path = temp_path("ok.pt");
  ConvNet a;
  torch::optim::Adam opt_a(a->parameters());
  save_checkpoint(path, *a, opt_a, {2, 17, 131, 2});
  ConvNet b;
  torch::optim::Adam opt_b(b->parameters());
  auto state = load_checkpoint(path, *b, opt_b);
  EXPECT_EQ(state.epoch, 2);
  EXPECT_EQ(state.step_in_epoch, 17);
  EXPECT_EQ(state.global_step, 131);
  EXPECT_EQ(state.world_size, 2);
  expect_unchanged(*b, copy_of(*a));
  unlink(path.c_str());
}

TEST(Checkpoint, AnotherModelsCheckpointIsRefusedUntouched) {
  const auto path = temp_path("other.pt");
  auto other = std::make_shared<OtherImpl>();
  torch::optim::Adam opt_other(other->parameters());
  save_checkpoint(path, *other, opt_other, {0, 0, 0, 1});
  ConvNet model;
  torch::optim::Adam opt(model->parameters());
  auto before = copy_of(*model);
  try {
    load_checkpoint(path, *model, opt);
    ADD_FAILURE() << "accepted another model's checkpoint";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(Contains(e.what(), "checkpoint " + path + " was written for a different model"));
    EXPECT_TRUE(Contains(e.what(), "fc.weight:[2, 4]"));
  }
  expect_unchanged(*model, before);
  unlink(path.c_str());
}

TEST(Checkpoint, TruncatedAndMissingFilesAreNamed) {
  const auto path = temp_path("cut.pt");
  ConvNet model;
  torch::optim::Adam opt(model->parameters());
  save_checkpoint(path, *model, opt, {1, 0, 10, 1});
  {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 3));
  }
  auto before = copy_of(*model);
  try {
    load_checkpoint(path, *model, opt);
    ADD_FAILURE() << "accepted a truncated checkpoint";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(Contains(e.what(), "checkpoint " + path + " is truncated or corrupt"));
  }
  expect_unchanged(*model, before);
  unlink(path.c_str());
  try {
    load_checkpoint(path, *model, opt);
    ADD_FAILURE() << "accepted a missing checkpoint";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(Contains(e.what(), "checkpoint " + path + " does not exist or is not readable"));
  }
}

}  // namespace
