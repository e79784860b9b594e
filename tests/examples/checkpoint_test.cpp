// The training example's checkpoints in one process: a checkpoint of another
// model, a damaged file or a damaged part of one (model tensors, optimizer
// state, counters, RNG state) is refused with a message naming the file and
// the problem, and the model and optimizer are left exactly as they were;
// a save that fails at any step names the file and leaves the previous
// checkpoint in place.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

#include "checkpoint_test_util.h"
#include "fashion_mnist/checkpoint.h"
#include "fashion_mnist/model.h"
#include "harness/assertions.h"

namespace {

using namespace checkpoint_test;
using dtrain::testing::Contains;
using dtrain::testing::what_thrown;

struct OtherImpl : torch::nn::Module {
  OtherImpl() { fc = register_module("fc", torch::nn::Linear(4, 2)); }
  torch::nn::Linear fc{nullptr};
};

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// A trained model and optimizer that a bad checkpoint must leave alone.
struct Target {
  ConvNet model;
  torch::optim::Adam opt{model->parameters()};
  Target() { step(*model, opt); }
};

// Loads `path` into a fresh Target and returns the error, checking that
// nothing in the target changed.
std::string refused(const std::string& path) {
  Target t;
  auto params = copy_of(*t.model);
  auto state = snapshot(t.opt);
  const auto rng = at::detail::getDefaultCPUGenerator().get_state();
  auto error = what_thrown<std::runtime_error>([&] { load_checkpoint(path, *t.model, t.opt); });
  expect_unchanged(*t.model, params);
  expect_unchanged(t.opt, state);
  EXPECT_TRUE(same_bits(at::detail::getDefaultCPUGenerator().get_state(), rng));
  return error;
}

TEST(Checkpoint, RoundTripRestoresModelOptimizerPositionAndRng) {
  const auto path = temp_path("ok.dtt");
  Target a;
  save_checkpoint(path, *a.model, a.opt, {2, 17, 131, 2});
  auto expected_rng = at::detail::getDefaultCPUGenerator().get_state();
  auto expected_opt = snapshot(a.opt);
  torch::randn({100});  // moves the RNG on
  ConvNet b;
  torch::optim::Adam opt_b(b->parameters());
  auto state = load_checkpoint(path, *b, opt_b);
  EXPECT_EQ(state.epoch, 2);
  EXPECT_EQ(state.step_in_epoch, 17);
  EXPECT_EQ(state.global_step, 131);
  EXPECT_EQ(state.world_size, 2);
  expect_unchanged(*b, copy_of(*a.model));
  expect_unchanged(opt_b, expected_opt);
  EXPECT_TRUE(same_bits(at::detail::getDefaultCPUGenerator().get_state(), expected_rng));
  EXPECT_FALSE(exists(path + ".tmp"));
  unlink(path.c_str());
}

// The group's options come back as they were saved (lr, betas, eps, weight
// decay, amsgrad), with amsgrad's extra state, as PyTorch's
// load_state_dict restores them.
TEST(Checkpoint, OptimizerOptionsAndAmsgradStateAreRestored) {
  const auto path = temp_path("options.dtt");
  ConvNet a;
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(0.125)
                                                .betas({0.5, 0.75})
                                                .eps(1e-6)
                                                .weight_decay(0.25)
                                                .amsgrad(true));
  step(*a, opt_a);
  save_checkpoint(path, *a, opt_a, {0, 1, 1, 1});
  ConvNet b;
  torch::optim::Adam opt_b(b->parameters());
  load_checkpoint(path, *b, opt_b);
  const auto& o = static_cast<const torch::optim::AdamOptions&>(opt_b.param_groups()[0].options());
  EXPECT_EQ(o.lr(), 0.125);
  EXPECT_EQ(std::get<0>(o.betas()), 0.5);
  EXPECT_EQ(std::get<1>(o.betas()), 0.75);
  EXPECT_EQ(o.eps(), 1e-6);
  EXPECT_EQ(o.weight_decay(), 0.25);
  EXPECT_TRUE(o.amsgrad());
  const auto p_a = a->parameters()[3];
  const auto p_b = b->parameters()[3];
  ASSERT_NE(adam_state(opt_b, p_b), nullptr);
  EXPECT_TRUE(same_bits(adam_state(opt_b, p_b)->max_exp_avg_sq(),
                        adam_state(opt_a, p_a)->max_exp_avg_sq()));
  // And they train on identically.
  torch::manual_seed(9);
  step(*a, opt_a);
  torch::manual_seed(9);
  step(*b, opt_b);
  expect_unchanged(*b, copy_of(*a));
  unlink(path.c_str());
}

TEST(Checkpoint, AnotherModelsCheckpointIsRefusedUntouched) {
  const auto path = temp_path("other.dtt");
  auto other = std::make_shared<OtherImpl>();
  torch::optim::Adam opt_other(other->parameters());
  save_checkpoint(path, *other, opt_other, {0, 0, 0, 1});
  auto error = refused(path);
  EXPECT_TRUE(Contains(error, "checkpoint " + path + " was written for a different model"));
  EXPECT_TRUE(Contains(error, "fc.weight:[2, 4]"));
  unlink(path.c_str());
}

TEST(Checkpoint, TruncatedAndMissingFilesAreNamed) {
  const auto path = temp_path("cut.dtt");
  Target source;
  save_checkpoint(path, *source.model, source.opt, {1, 0, 10, 1});
  {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 3));
  }
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path + " is truncated or corrupt"));
  unlink(path.c_str());
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path + " does not exist or is not readable"));
}

// The model part is fine; the optimizer part claims a group of 2
// parameters, not 8: refused before the model is touched.
TEST(Checkpoint, CorruptOptimizerPartLeavesModelBitIdentical) {
  const auto path = temp_path("opt.dtt");
  Target source;
  auto f = good_contents(*source.model, source.opt);
  f.tensors["optimizer/group/0/size"] = torch::tensor({int64_t{2}});
  write_contents(path, f);
  auto error = refused(path);
  EXPECT_TRUE(Contains(error, "checkpoint " + path +
                                  " has an optimizer state that does not fit this optimizer: "
                                  "parameter group 0 holds 2 parameters in the checkpoint, 8 "
                                  "here"));
  unlink(path.c_str());
}

// Adam state of shape [3] for a parameter of [32, 1, 5, 5]: libtorch would
// load it without a look at the shapes, and the first step would fail (or
// broadcast).
TEST(Checkpoint, OptimizerStateOfTheWrongShapeIsRefused) {
  const auto path = temp_path("shape.dtt");
  Target source;
  auto f = good_contents(*source.model, source.opt);
  f.tensors["optimizer/state/0/exp_avg"] = torch::zeros({3});
  write_contents(path, f);
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path +
                                          " has a bad optimizer state for conv1.weight: exp_avg "
                                          "is Float [3], the parameter Float [32, 1, 5, 5]"));
  f = good_contents(*source.model, source.opt);
  f.tensors["optimizer/state/7/step"] = torch::tensor({int64_t{0}});
  write_contents(path, f);
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path +
                                          " has a bad optimizer state for fc2.bias: step is 0 "
                                          "(expected at least 1)"));
  unlink(path.c_str());
}

// Names and shapes match (the signature too); the last tensor is Double.
TEST(Checkpoint, ModelTensorOfTheWrongDtypeIsRefusedUntouched) {
  const auto path = temp_path("dtype.dtt");
  Target source;
  auto f = good_contents(*source.model, source.opt);
  f.tensors["model/fc2.bias"] = torch::zeros({10}, torch::kDouble);
  write_contents(path, f);
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path +
                                          " has the model tensor fc2.bias as Double [10]; this "
                                          "model's is Float [10]"));
  unlink(path.c_str());
}

// An entry the program does not expect, a missing one, another program's
// file: each refused by name.
TEST(Checkpoint, MissingUnexpectedAndForeignEntriesAreRefused) {
  const auto path = temp_path("entries.dtt");
  Target source;
  auto f = good_contents(*source.model, source.opt);
  f.tensors["model/extra"] = torch::zeros({1});
  write_contents(path, f);
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path + " has an unexpected entry model/extra"));
  f = good_contents(*source.model, source.opt);
  f.tensors.erase("model/conv2.bias");
  write_contents(path, f);
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path + " lacks the model tensor conv2.bias"));
  f = good_contents(*source.model, source.opt);
  f.metadata["format"] = "something-else/2";
  write_contents(path, f);
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path +
                                          " is not a checkpoint of this program (format "
                                          "\"something-else/2\""));
  unlink(path.c_str());
}

TEST(Checkpoint, BadRngStateIsRefusedUntouched) {
  const auto path = temp_path("rng.dtt");
  Target source;
  auto f = good_contents(*source.model, source.opt);
  f.tensors["rng"] = torch::zeros({3}, torch::kUInt8);
  write_contents(path, f);
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path + " has an invalid RNG state (Byte [3])"));
  unlink(path.c_str());
}

struct CounterCase {
  std::string key;
  torch::Tensor value;
  std::string message;
};

TEST(Checkpoint, ImpossibleCountersAreRefusedUntouched) {
  const auto path = temp_path("counters.dtt");
  const CounterCase cases[] = {
      {"epoch", torch::tensor({int64_t{-1}}), "has epoch = -1 (expected at least 0)"},
      {"world_size", torch::tensor({int64_t{0}}), "has world_size = 0 (expected at least 1)"},
      {"global_step", torch::tensor({int64_t{1}}), "has global_step = 1 (expected at least 2)"},
      {"step_in_epoch", torch::tensor({2.5}),
       "has a corrupt counter step_in_epoch (Float [1], expected a single Long)"},
      {"epoch", torch::tensor({int64_t{1}, int64_t{2}}),
       "has a corrupt counter epoch (Long [2], expected a single Long)"},
  };
  Target source;
  for (const auto& c : cases) {
    auto f = good_contents(*source.model, source.opt);
    f.tensors["state/" + c.key] = c.value;
    write_contents(path, f);
    EXPECT_TRUE(Contains(refused(path), "checkpoint " + path + " " + c.message)) << c.key;
  }
  unlink(path.c_str());
}

// fsync of the temporary file fails: the error names it, and the previous
// checkpoint is still the one under the final name.
TEST(Checkpoint, FailedFsyncKeepsThePreviousCheckpoint) {
  const auto path = temp_path("fsync.dtt");
  Target source;
  save_checkpoint(path, *source.model, source.opt, {1, 0, 19, 1});
  CheckpointFaults faults;
  faults.fsync_errno = EIO;
  auto error = what_thrown<std::runtime_error>(
      [&] { save_checkpoint(path, *source.model, source.opt, {2, 0, 38, 1}, faults); });
  EXPECT_TRUE(Contains(error, "cannot save checkpoint " + path + ": cannot fsync " + path +
                                  ".tmp: Input/output error"));
  EXPECT_FALSE(exists(path + ".tmp"));
  ConvNet b;
  torch::optim::Adam opt_b(b->parameters());
  EXPECT_EQ(load_checkpoint(path, *b, opt_b).epoch, 1);
  unlink(path.c_str());
}

// A directory that cannot hold files (its "parent" is a regular file, which
// stops root too): the error names the temporary file and the reason.
TEST(Checkpoint, UnwritableDirectoryIsNamed) {
  const auto blocker = temp_path("blocker");
  std::ofstream(blocker) << "a file, not a directory";
  const auto path = blocker + "/checkpoint.dtt";
  Target source;
  auto error = what_thrown<std::runtime_error>(
      [&] { save_checkpoint(path, *source.model, source.opt, {1, 0, 19, 1}); });
  EXPECT_TRUE(Contains(error, "cannot save checkpoint " + path + ": cannot create " + path +
                                  ".tmp: Not a directory"));
  unlink(blocker.c_str());
}

// The final name is taken by a directory: the rename fails, is named, and
// the temporary file does not stay behind.
TEST(Checkpoint, FailedRenameRemovesTheTemporaryFile) {
  const auto path = temp_path("taken.dtt");
  ASSERT_EQ(mkdir(path.c_str(), 0755), 0);
  std::ofstream(path + "/keep") << "x";
  Target source;
  auto error = what_thrown<std::runtime_error>(
      [&] { save_checkpoint(path, *source.model, source.opt, {1, 0, 19, 1}); });
  EXPECT_TRUE(Contains(error, "cannot save checkpoint " + path + ": cannot rename " + path +
                                  ".tmp to " + path + ": Is a directory"));
  EXPECT_FALSE(exists(path + ".tmp"));
  unlink((path + "/keep").c_str());
  rmdir(path.c_str());
}

}  // namespace
