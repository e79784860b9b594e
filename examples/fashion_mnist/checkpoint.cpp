#include "checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace {

// Names, dtypes and shapes of everything the model saves, in order.
std::string signature(torch::nn::Module& model) {
  std::ostringstream out;
  for (const auto& p : model.named_parameters()) out << p.key() << ":" << p.value().sizes() << ";";
  for (const auto& b : model.named_buffers()) out << b.key() << ":" << b.value().sizes() << ";";
  return out.str();
}

void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) throw std::runtime_error("checkpoint: cannot open " + path + " to sync it");
  ::fsync(fd);
  ::close(fd);
}

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

torch::Tensor scalar(int64_t v) { return torch::tensor({v}, torch::kLong); }

int64_t read_scalar(torch::serialize::InputArchive& in, const std::string& key) {
  torch::Tensor t;
  in.read(key, t);
  return t.item<int64_t>();
}

}  // namespace

void save_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt,
                     const TrainingState& state, const CheckpointFaults& faults) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive, opt_archive;
  model.save(model_archive);
  opt.save(opt_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", opt_archive);
  archive.write("signature", c10::IValue(signature(model)));
  archive.write("epoch", scalar(state.epoch));
  archive.write("step_in_epoch", scalar(state.step_in_epoch));
  archive.write("global_step", scalar(state.global_step));
  archive.write("world_size", scalar(state.world_size));
  archive.write("rng", at::detail::getDefaultCPUGenerator().get_state());

  const std::string tmp = path + ".tmp";
  if (faults.die_while_writing) {
    // Simulate a crash in the middle of writing: a partial temporary file.
    std::ostringstream bytes;
    archive.save_to(bytes);
    std::ofstream partial(tmp, std::ios::binary | std::ios::trunc);
    const auto s = bytes.str();
    partial.write(s.data(), static_cast<std::streamsize>(s.size() / 2));
    partial.flush();
    raise(SIGKILL);
  }
  archive.save_to(tmp);
  fsync_path(tmp, O_RDONLY);
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("checkpoint: cannot rename " + tmp + " to " + path);
  fsync_path(dir_of(path), O_RDONLY | O_DIRECTORY);
}

TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer& opt) {
  if (::access(path.c_str(), R_OK) != 0)
    throw std::runtime_error("checkpoint " + path + " does not exist or is not readable");
  torch::serialize::InputArchive archive;
  TrainingState state;
  torch::Tensor rng;
  c10::IValue sig;
  torch::serialize::InputArchive model_archive, opt_archive;
  try {
    archive.load_from(path);
    archive.read("signature", sig);
    archive.read("model", model_archive);
    archive.read("optimizer", opt_archive);
    state.epoch = read_scalar(archive, "epoch");
    state.step_in_epoch = read_scalar(archive, "step_in_epoch");
    state.global_step = read_scalar(archive, "global_step");
    state.world_size = read_scalar(archive, "world_size");
    archive.read("rng", rng);
  } catch (const c10::Error& e) {
    throw std::runtime_error("checkpoint " + path + " is truncated or corrupt: " +
                             e.what_without_backtrace());
  }
  const std::string saved = sig.isString() ? sig.toStringRef() : "";
  if (saved != signature(model))
    throw std::runtime_error("checkpoint " + path +
                             " was written for a different model (its parameters: " + saved +
                             "; this model's: " + signature(model) + ")");
  // The whole file was read (load_from materializes every tensor) and the
  // model's layout checked; only now is anything modified.
  try {
    model.load(model_archive);
    opt.load(opt_archive);
  } catch (const c10::Error& e) {
    throw std::runtime_error("checkpoint " + path + " could not be applied: " +
                             e.what_without_backtrace());
  }
  auto generator = at::detail::getDefaultCPUGenerator();  // a handle; set_state needs non-const
  generator.set_state(rng);
  return state;
}
