// The training example's checkpoints, saved and loaded by one rank: a
// checkpoint of another model, a damaged file or a damaged entry (model
// tensors, optimizer state and options, counters, RNG state) is refused
// with a message naming the directory and the problem, and the model, the
// optimizer and the RNG are left exactly as they were; a save that fails
// names the directory and leaves the previous checkpoint in place.

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

struct OtherImpl : torch::nn::Module {
  OtherImpl() { fc = register_module("fc", torch::nn::Linear(4, 2)); }
  torch::nn::Linear fc{nullptr};
};

// A trained model and optimizer that a bad checkpoint must leave alone.
struct Target {
  ConvNet model;
  torch::optim::Adam opt{model->parameters()};
  Target() { step(*model, opt); }
};

// A checkpoint of a trained model (epoch 1, 640 samples into it), in a
// fresh directory.
struct Saved {
  std::string dir;
  Target source;
  explicit Saved(const std::string& name) : dir(temp_path(name)) {
    save_alone(dir, *source.model, source.opt, {1, 640, 21, 1});
  }
  ~Saved() { remove_dir(dir); }
};

// Loads `dir` into a fresh Target and returns the error, checking that
// nothing in the target changed.
std::string refused(const std::string& dir) {
  Target t;
  auto params = copy_of(*t.model);
  auto state = snapshot(t.opt);
  const double lr = static_cast<torch::optim::AdamOptions&>(t.opt.param_groups()[0].options()).lr();
  const auto rng = at::detail::getDefaultCPUGenerator().get_state();
  const auto error = load_alone(dir, *t.model, t.opt);
  expect_unchanged(*t.model, params);
  expect_unchanged(t.opt, state);
  EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(t.opt.param_groups()[0].options()).lr(), lr);
  EXPECT_TRUE(same_bits(at::detail::getDefaultCPUGenerator().get_state(), rng));
  EXPECT_FALSE(error.empty()) << "loaded";
  return error;
}

std::string prefix(const std::string& dir) { return "rank 0: cannot load checkpoint " + dir + ": "; }

TEST(Checkpoint, RoundTripRestoresModelOptimizerPositionAndRng) {
  const auto dir = temp_path("ok");
  Target a;
  save_alone(dir, *a.model, a.opt, {2, 544, 131, 2});
  auto expected_rng = at::detail::getDefaultCPUGenerator().get_state();
  auto expected_opt = snapshot(a.opt);
  torch::randn({100});  // moves the RNG on
  ConvNet b;
  torch::optim::Adam opt_b(b->parameters());
  TrainingState state;
  EXPECT_EQ(load_alone(dir, *b, opt_b, &state), "");
  EXPECT_EQ(state.epoch, 2);
  EXPECT_EQ(state.samples_in_epoch, 544);
  EXPECT_EQ(state.global_step, 131);
  EXPECT_EQ(state.world_size, 2);
  expect_unchanged(*b, copy_of(*a.model));
  expect_unchanged(opt_b, expected_opt);
  EXPECT_TRUE(same_bits(at::detail::getDefaultCPUGenerator().get_state(), expected_rng));
  remove_dir(dir);
}

// The group's options come back as they were saved (lr, betas, eps, weight
// decay), with amsgrad's extra state, as PyTorch's load_state_dict restores
// them; a checkpoint written with amsgrad on does not load into an Adam
// with it off.
TEST(Checkpoint, OptimizerOptionsAndAmsgradStateAreRestored) {
  const auto dir = temp_path("options");
  auto options = [](double lr) {
    return torch::optim::AdamOptions(lr).betas({0.5, 0.75}).eps(1e-6).weight_decay(0.25).amsgrad(true);
  };
  ConvNet a;
  torch::optim::Adam opt_a(a->parameters(), options(0.125));
  step(*a, opt_a);
  save_alone(dir, *a, opt_a, {0, 32, 1, 1});
  ConvNet b;
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions().amsgrad(true));
  EXPECT_EQ(load_alone(dir, *b, opt_b), "");
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
  EXPECT_TRUE(Contains(refused(dir), prefix(dir) + "was written with Adam's amsgrad on; this "
                                                   "optimizer has it off"));
  remove_dir(dir);
}

TEST(Checkpoint, AnotherModelsCheckpointIsRefusedUntouched) {
  const auto dir = temp_path("other");
  auto other = std::make_shared<OtherImpl>();
  torch::optim::Adam opt_other(other->parameters());
  save_alone(dir, *other, opt_other, {0, 0, 0, 1});
  auto error = refused(dir);
  EXPECT_TRUE(Contains(error, prefix(dir) + "was written for a different model"));
  EXPECT_TRUE(Contains(error, "fc.weight:[2, 4]"));
  remove_dir(dir);
}

TEST(Checkpoint, TruncatedAndMissingFilesAreNamed) {
  Saved saved("cut");
  const auto data = data_file(saved.dir);
  ASSERT_EQ(::truncate(data.c_str(), 1000), 0);
  EXPECT_TRUE(Contains(refused(saved.dir), prefix(saved.dir) + "tensor file " + data + ": truncated"));
  ASSERT_EQ(::unlink((saved.dir + "/metadata.dtt").c_str()), 0);
  EXPECT_TRUE(Contains(refused(saved.dir), prefix(saved.dir) + "tensor file " + saved.dir +
                                               "/metadata.dtt: cannot open: No such file or directory"));
}

// Adam state of shape [3] for a parameter of [32, 1, 5, 5]: libtorch would
// take it without a look at the shapes, and the first step would fail (or
// broadcast). A negative step count is refused too.
TEST(Checkpoint, OptimizerStateOfTheWrongShapeIsRefused) {
  Saved saved("shape");
  edit_data(saved.dir, [](auto& t) { t["r/optimizer/optim/conv1.weight/exp_avg"] = torch::zeros({3}); });
  EXPECT_TRUE(Contains(refused(saved.dir),
                       prefix(saved.dir) + "'optimizer/optim/conv1.weight/exp_avg' has shape [3] in "
                                           "the checkpoint but [32, 1, 5, 5] here"));
  Saved negative("step");
  edit_data(negative.dir, [](auto& t) { t["r/optimizer/optim/fc2.bias/step"] = torch::tensor(int64_t{-3}); });
  EXPECT_TRUE(Contains(refused(negative.dir), prefix(negative.dir) + "has a bad optimizer state: "
                                                                     "optimizer/optim/fc2.bias/step is -3"));
}

// Names and shapes match (the model's layout too); the last tensor is Double.
TEST(Checkpoint, ModelTensorOfTheWrongDtypeIsRefusedUntouched) {
  Saved saved("dtype");
  edit_data(saved.dir, [](auto& t) { t["r/model/param/fc2.bias"] = torch::zeros({10}, torch::kDouble); });
  EXPECT_TRUE(Contains(refused(saved.dir), prefix(saved.dir) + "'model/param/fc2.bias' is Double in "
                                                               "the checkpoint but Float here"));
}

// An entry the program does not expect, a missing one, another program's
// checkpoint: each refused by name.
TEST(Checkpoint, MissingUnexpectedAndForeignEntriesAreRefused) {
  Saved saved("entries");
  edit_metadata(saved.dir, [](auto& m) { m["replicated/model/extra"] = "0"; });
  EXPECT_TRUE(Contains(refused(saved.dir), prefix(saved.dir) + "has an unexpected entry model/extra"));
  edit_metadata(saved.dir, [](auto& m) {
    m.erase("replicated/model/extra");
    m.erase("replicated/model/param/conv2.bias");
  });
  EXPECT_TRUE(Contains(refused(saved.dir), prefix(saved.dir) + "lacks the entry model/param/conv2.bias"));
  edit_metadata(saved.dir, [](auto& m) { m["u/program"] = "something-else/2"; });
  EXPECT_TRUE(Contains(refused(saved.dir), prefix(saved.dir) + "is not a checkpoint of this program "
                                                               "(program \"something-else/2\""));
}

TEST(Checkpoint, BadRngStateIsRefusedUntouched) {
  Saved saved("rng");
  edit_data(saved.dir, [](auto& t) { t["r/rng"].zero_(); });  // a zero mt19937 state is invalid
  EXPECT_TRUE(Contains(refused(saved.dir), prefix(saved.dir) + "has an invalid RNG state"));
}

struct MetadataCase {
  std::string key, value, message;
};

TEST(Checkpoint, ImpossibleCountersAndOptionsAreRefusedUntouched) {
  const MetadataCase cases[] = {
      {"epoch", "-1", "has epoch = -1 (expected 0 to"},
      {"world_size", "0", "has world_size = 0 (expected 1 to 1048576)"},
      {"samples_in_epoch", "1201", "has samples_in_epoch = 1201 (expected 0 to 1200)"},
      {"global_step", "2.5", "has a corrupt counter global_step \"2.5\""},
      {"adam/lr", "nan", "has a bad optimizer option adam/lr \"nan\""},
  };
  for (const auto& c : cases) {
    Saved saved("counters");
    edit_metadata(saved.dir, [&](auto& m) { m["u/" + c.key] = c.value; });
    EXPECT_TRUE(Contains(refused(saved.dir), prefix(saved.dir) + c.message)) << c.key;
  }
}

// fsync of the data file fails: the error names the directory, the rank and
// the file, and the previous checkpoint is still the one that loads.
TEST(Checkpoint, FailedFsyncKeepsThePreviousCheckpoint) {
  Saved saved("fsync");
  CheckpointFaults faults;
  faults.fsync_errno = EIO;
  auto error = on_ranks(1, [&](const auto& group) {
    save_checkpoint(group, saved.dir, *saved.source.model, saved.source.opt, {2, 0, 38, 1}, faults);
  })[0];
  EXPECT_TRUE(Contains(error, "cannot save checkpoint " + saved.dir + ": rank 0: cannot save tensor file " +
                                  saved.dir + "/data-"));
  EXPECT_TRUE(Contains(error, ".tmp: Input/output error"));
  ConvNet b;
  torch::optim::Adam opt_b(b->parameters());
  TrainingState state;
  EXPECT_EQ(load_alone(saved.dir, *b, opt_b, &state), "");
  EXPECT_EQ(state.epoch, 1);
}

// A directory that cannot be made (its "parent" is a regular file, which
// stops root too): the error names it and the reason.
TEST(Checkpoint, UnwritableDirectoryIsNamed) {
  const auto blocker = temp_path("blocker");
  std::ofstream(blocker) << "a file, not a directory";
  const auto dir = blocker + "/checkpoints";
  Target source;
  auto error = on_ranks(1, [&](const auto& group) {
    save_checkpoint(group, dir, *source.model, source.opt, {1, 0, 19, 1});
  })[0];
  EXPECT_EQ(error, "cannot save checkpoint " + dir + ": rank 0: checkpoint: cannot create directory " +
                       dir + ": Not a directory");
  ::unlink(blocker.c_str());
}

}  // namespace
