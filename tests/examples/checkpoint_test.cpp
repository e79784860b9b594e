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
  const auto path = temp_path("ok.pt");
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

TEST(Checkpoint, AnotherModelsCheckpointIsRefusedUntouched) {
  const auto path = temp_path("other.pt");
  auto other = std::make_shared<OtherImpl>();
  torch::optim::Adam opt_other(other->parameters());
  save_checkpoint(path, *other, opt_other, {0, 0, 0, 1});
  auto error = refused(path);
  EXPECT_TRUE(Contains(error, "checkpoint " + path + " was written for a different model"));
  EXPECT_TRUE(Contains(error, "fc.weight:[2, 4]"));
  unlink(path.c_str());
}

TEST(Checkpoint, TruncatedAndMissingFilesAreNamed) {
  const auto path = temp_path("cut.pt");
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

// The model part is fine; the optimizer part is another optimizer's (one
// parameter group of 2 parameters, not 8). libtorch's Adam::load refuses
// it, but the model must not have been loaded before that.
TEST(Checkpoint, CorruptOptimizerPartLeavesModelBitIdentical) {
  const auto path = temp_path("opt.pt");
  Target source;
  auto other = std::make_shared<OtherImpl>();
  torch::optim::Adam opt_other(other->parameters());
  step(*other, opt_other);
  write_parts(path, *source.model, opt_other, signature(*source.model), good_entries());
  auto error = refused(path);
  EXPECT_TRUE(Contains(error, "checkpoint " + path +
                                  " has an optimizer state that does not fit this optimizer: "
                                  "loaded state dict contains a parameter group that has a "
                                  "different size"));
  unlink(path.c_str());
}

// Adam state for 8 parameters of shape [3]: libtorch loads it without a
// look at the shapes, and the first step would fail (or broadcast).
TEST(Checkpoint, OptimizerStateOfTheWrongShapeIsRefused) {
  const auto path = temp_path("shape.pt");
  Target source;
  std::vector<torch::Tensor> small;
  for (int i = 0; i < 8; ++i) small.push_back(torch::zeros({3}, torch::requires_grad()));
  torch::optim::Adam opt_small(small);
  opt_small.zero_grad();
  for (auto& t : small) t.sum().backward();
  opt_small.step();
  write_parts(path, *source.model, opt_small, signature(*source.model), good_entries());
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path +
                                          " has a bad optimizer state for conv1.weight: exp_avg "
                                          "is Float [3], the parameter Float [32, 1, 5, 5]"));
  unlink(path.c_str());
}

// Names and shapes match (the signature too); the last tensor is Double.
TEST(Checkpoint, ModelTensorOfTheWrongDtypeIsRefusedUntouched) {
  const auto path = temp_path("dtype.pt");
  Target source;
  {
    torch::NoGradGuard no_grad;
    source.model->fc2->bias.set_data(source.model->fc2->bias.to(torch::kDouble));
  }
  torch::optim::Adam opt(source.model->parameters());
  write_parts(path, *source.model, opt, signature(*source.model), good_entries());
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path +
                                          " has the model tensor fc2.bias as Double [10]; this "
                                          "model's is Float [10]"));
  unlink(path.c_str());
}

TEST(Checkpoint, BadRngStateIsRefusedUntouched) {
  const auto path = temp_path("rng.pt");
  Target source;
  auto entries = good_entries();
  entries["rng"] = torch::zeros({3}, torch::kUInt8);
  write_parts(path, *source.model, source.opt, signature(*source.model), entries);
  EXPECT_TRUE(Contains(refused(path), "checkpoint " + path + " has an invalid RNG state (Byte [3])"));
  unlink(path.c_str());
}

struct CounterCase {
  std::string key;
  torch::Tensor value;
  std::string message;
};

TEST(Checkpoint, ImpossibleCountersAreRefusedUntouched) {
  const auto path = temp_path("counters.pt");
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
    auto entries = good_entries();
    entries[c.key] = c.value;
    write_parts(path, *source.model, source.opt, signature(*source.model), entries);
    EXPECT_TRUE(Contains(refused(path), "checkpoint " + path + " " + c.message)) << c.key;
  }
  unlink(path.c_str());
}

// fsync of the temporary file fails: the error names it, and the previous
// checkpoint is still the one under the final name.
TEST(Checkpoint, FailedFsyncKeepsThePreviousCheckpoint) {
  const auto path = temp_path("fsync.pt");
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
  const auto path = blocker + "/checkpoint.pt";
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
  const auto path = temp_path("taken.pt");
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
