#include "checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace {

// Names and shapes of everything the model saves, in order. Stored in the
// file so that a checkpoint of another model is refused with both layouts.
std::string signature(torch::nn::Module& model) {
  std::ostringstream out;
  for (const auto& p : model.named_parameters()) out << p.key() << ":" << p.value().sizes() << ";";
  for (const auto& b : model.named_buffers()) out << b.key() << ":" << b.value().sizes() << ";";
  return out.str();
}

std::string describe(const torch::Tensor& t) {
  if (!t.defined()) return "missing";
  std::ostringstream out;
  out << t.scalar_type() << " " << t.sizes();
  return out.str();
}

torch::Tensor scalar(int64_t v) { return torch::tensor({v}, torch::kLong); }

// --- saving ----------------------------------------------------------------

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// Every failure of the write path reads "cannot save checkpoint <path>: cannot
// <step> <file>: <errno text>".
// Callers pass errno as read right after the failed call (the message
// building below may allocate).
struct SaveError {
  const std::string& path;
  [[noreturn]] void operator()(const char* what, const std::string& file, int err) const {
    throw std::runtime_error("cannot save checkpoint " + path + ": " + what + file + ": " +
                             std::strerror(err));
  }
};

void write_all(int fd, const std::string& bytes, size_t count, const std::string& tmp,
               const SaveError& fail) {
  for (size_t done = 0; done < count;) {
    const ssize_t n = ::write(fd, bytes.data() + done, count - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("cannot write ", tmp, errno);
    done += static_cast<size_t>(n);
  }
}

// The temporary file, fsynced and renamed over `path`; on failure it is
// removed and `path` is untouched.
void replace_durably(const std::string& path, const std::string& bytes,
                     const CheckpointFaults& faults) {
  const SaveError fail{path};
  const std::string tmp = path + ".tmp";  // same directory: rename is atomic
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create ", tmp, errno);
  try {
    if (faults.die_while_writing) {  // a crash in the middle of writing: a partial file
      write_all(fd, bytes, bytes.size() / 2, tmp, fail);
      raise(SIGKILL);
    }
    write_all(fd, bytes, bytes.size(), tmp, fail);
    const int synced = faults.fsync_errno != 0 ? (errno = faults.fsync_errno, -1) : ::fsync(fd);
    if (synced != 0) fail("cannot fsync ", tmp, errno);
    const int closed = ::close(fd);
    fd = -1;
    if (closed != 0) fail("cannot close ", tmp, errno);
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      fail("cannot rename ", tmp + " to " + path, err);
    }
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  // The rename is durable only once the directory entry is on disk.
  const std::string dir = dir_of(path);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) fail("cannot open directory ", dir, errno);
  const int synced = ::fsync(dir_fd);
  const int err = errno;
  ::close(dir_fd);
  if (synced != 0)  // the new checkpoint is in place but may not survive a crash
    fail("cannot fsync directory ", dir, err);
}

// --- loading: every check runs before anything is modified ------------------

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw std::runtime_error("checkpoint " + path + " " + what);
}

// What Module::load would read into each parameter and buffer (the same
// keys, submodule by submodule), checked without reading into them.
void check_module(const std::string& path, torch::nn::Module& module,
                  torch::serialize::InputArchive& archive, const std::string& prefix) {
  auto check = [&](const std::string& key, const torch::Tensor& mine, bool buffer) {
    torch::Tensor saved;
    if (!archive.try_read(key, saved, buffer))
      refuse(path, "lacks the model tensor " + prefix + key);
    if (saved.scalar_type() != mine.scalar_type() || saved.sizes() != mine.sizes() ||
        saved.layout() != mine.layout())
      refuse(path, "has the model tensor " + prefix + key + " as " + describe(saved) +
                       "; this model's is " + describe(mine));
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) check(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) check(b.key(), b.value(), true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;  // Module::load skips these too
    torch::serialize::InputArchive child_archive;
    if (!archive.try_read(child.key(), child_archive))
      refuse(path, "lacks the model's submodule " + prefix + child.key());
    check_module(path, *child.value(), child_archive, prefix + child.key() + ".");
  }
}

// Adam's per-parameter state, as Adam::step will use it against `param`.
std::string adam_state_problem(const torch::optim::AdamParamState& s, const torch::Tensor& param,
                               bool amsgrad) {
  if (s.step() < 1) return "step is " + std::to_string(s.step()) + " (expected at least 1)";
  auto fits = [&](const torch::Tensor& t) {
    return t.defined() && t.scalar_type() == param.scalar_type() && t.sizes() == param.sizes();
  };
  const std::pair<const char*, const torch::Tensor*> tensors[] = {
      {"exp_avg", &s.exp_avg()}, {"exp_avg_sq", &s.exp_avg_sq()},
      {"max_exp_avg_sq", &s.max_exp_avg_sq()}};
  for (const auto& [name, t] : tensors) {
    const bool needed = std::strcmp(name, "max_exp_avg_sq") != 0 || amsgrad;
    if ((needed || t->defined()) && !fits(*t))
      return std::string(name) + " is " + describe(*t) + ", the parameter " + describe(param);
  }
  return "";
}

// Loads the optimizer part into a scratch Adam over stand-ins of `opt`'s
// parameters (same groups, dtypes and shapes), then checks each parameter's
// state: libtorch's Adam::load checks only the group sizes, so a state of
// the wrong shape would load and then fail in the first step.
void check_optimizer(const std::string& path, torch::nn::Module& model,
                     const torch::optim::Adam& opt, torch::serialize::InputArchive& archive) {
  c10::IValue version;
  // Archives without it take libtorch's pre-1.5 path, which indexes
  // parameters by the file's counts unchecked.
  if (!archive.try_read("pytorch_version", version) || !version.isString() ||
      version.toStringRef() != "1.5.0")
    refuse(path, "has an optimizer state that is not libtorch's Adam format 1.5.0");
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& group : opt.param_groups()) {
    std::vector<torch::Tensor> stand_ins;
    for (const auto& p : group.params()) stand_ins.push_back(torch::empty_like(p));
    groups.emplace_back(std::move(stand_ins), group.options().clone());
  }
  torch::optim::Adam scratch(std::move(groups),
                             static_cast<const torch::optim::AdamOptions&>(opt.defaults()));
  try {
    scratch.load(archive);
  } catch (const c10::Error& e) {
    refuse(path, "has an optimizer state that does not fit this optimizer: " +
                     std::string(e.what_without_backtrace()));
  }
  std::map<const void*, std::string> names;
  for (const auto& p : model.named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& params = opt.param_groups()[g].params();
    const auto& stand_ins = scratch.param_groups()[g].params();
    const bool amsgrad = static_cast<const torch::optim::AdamOptions&>(
                             opt.param_groups()[g].options()).amsgrad();
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = scratch.state().find(c10::guts::to_string(stand_ins[i].unsafeGetTensorImpl()));
      if (it == scratch.state().end()) continue;  // never stepped: no state, as when saved
      const auto problem = adam_state_problem(
          static_cast<const torch::optim::AdamParamState&>(*it->second), params[i], amsgrad);
      if (problem.empty()) continue;
      auto name = names.find(params[i].unsafeGetTensorImpl());
      refuse(path, "has a bad optimizer state for " +
                       (name != names.end() ? name->second
                                            : "parameter " + std::to_string(i) + " of group " +
                                                  std::to_string(g)) +
                       ": " + problem);
    }
  }
}

int64_t read_counter(const std::string& path, torch::serialize::InputArchive& archive,
                     const char* key, int64_t min) {
  torch::Tensor t;
  if (!archive.try_read(key, t)) refuse(path, std::string("lacks the counter ") + key);
  if (t.scalar_type() != torch::kLong || t.numel() != 1)
    refuse(path, std::string("has a corrupt counter ") + key + " (" + describe(t) +
                     ", expected a single Long)");
  const int64_t v = t.item<int64_t>();
  if (v < min)
    refuse(path, std::string("has ") + key + " = " + std::to_string(v) + " (expected at least " +
                     std::to_string(min) + ")");
  return v;
}

TrainingState read_state(const std::string& path, torch::serialize::InputArchive& archive) {
  TrainingState s;
  s.epoch = read_counter(path, archive, "epoch", 0);
  s.step_in_epoch = read_counter(path, archive, "step_in_epoch", 0);
  s.global_step = read_counter(path, archive, "global_step", s.step_in_epoch);
  s.world_size = read_counter(path, archive, "world_size", 1);
  return s;
}

// Set on a generator of our own first: set_state checks the size and the
// dtype of the state, and the default generator is touched only in apply().
torch::Tensor read_rng(const std::string& path, torch::serialize::InputArchive& archive) {
  torch::Tensor rng;
  if (!archive.try_read("rng", rng)) refuse(path, "lacks the RNG state");
  try {
    auto scratch = at::make_generator<at::CPUGeneratorImpl>();
    scratch.set_state(rng);
  } catch (const c10::Error& e) {
    refuse(path, "has an invalid RNG state (" + describe(rng) +
                     "): " + e.what_without_backtrace());
  }
  return rng;
}

}  // namespace

void save_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt,
                     const TrainingState& state, const CheckpointFaults& faults) {
  std::ostringstream bytes;
  try {
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
    archive.save_to(bytes);
  } catch (const c10::Error& e) {
    throw std::runtime_error("cannot save checkpoint " + path + ": serializing failed: " +
                             e.what_without_backtrace());
  }
  replace_durably(path, bytes.str(), faults);
}

Checkpoint read_checkpoint(const std::string& path, torch::nn::Module& model,
                           const torch::optim::Adam& opt) {
  if (::access(path.c_str(), R_OK) != 0)
    refuse(path, "does not exist or is not readable");
  Checkpoint c;
  c.path_ = path;
  torch::serialize::InputArchive archive;
  c10::IValue sig;
  try {  // load_from materializes every tensor: a truncated file fails here
    archive.load_from(path);
    archive.read("signature", sig);
    archive.read("model", c.model_);
    archive.read("optimizer", c.optimizer_);
  } catch (const c10::Error& e) {
    refuse(path, std::string("is truncated or corrupt: ") + e.what_without_backtrace());
  }
  const std::string saved = sig.isString() ? sig.toStringRef() : "";
  if (saved != signature(model))
    refuse(path, "was written for a different model (its parameters: " + saved +
                     "; this model's: " + signature(model) + ")");
  check_module(path, model, c.model_, "");
  check_optimizer(path, model, opt, c.optimizer_);
  c.state_ = read_state(path, archive);
  c.rng_ = read_rng(path, archive);
  return c;
}

void Checkpoint::apply(torch::nn::Module& model, torch::optim::Adam& opt) {
  try {
    model.load(model_);
    opt.load(optimizer_);
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(rng_);
  } catch (const c10::Error& e) {
    refuse(path_, std::string("could not be applied: ") + e.what_without_backtrace());
  }
}

TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Adam& opt) {
  Checkpoint c = read_checkpoint(path, model, opt);
  c.apply(model, opt);
  return c.state();
}

// --- the collective forms ---------------------------------------------------

// Two collectives when all succeeded (one all_reduce), four otherwise: the
// lowest failing rank is found with MIN, then broadcasts its message.
void fail_together(dtrain::ProcessGroup& group, const std::string& error) {
  const int64_t none = group.size();
  auto first = torch::tensor({error.empty() ? none : static_cast<int64_t>(group.rank())});
  group.all_reduce(first, dtrain::ReduceOp::MIN)->wait();
  const int64_t failed = first.item<int64_t>();
  if (failed == none) return;
  const int root = static_cast<int>(failed);
  auto length = torch::tensor({static_cast<int64_t>(error.size())});
  group.broadcast(length, root)->wait();
  auto text = torch::zeros({length.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == root) std::memcpy(text.data_ptr(), error.data(), error.size());
  group.broadcast(text, root)->wait();
  const auto* chars = static_cast<const char*>(text.data_ptr());
  throw std::runtime_error("rank " + std::to_string(root) + ": " +
                           std::string(chars, chars + text.numel()));
}

void save_checkpoint_from_rank0(dtrain::ProcessGroup& group, const std::string& path,
                                torch::nn::Module& model, torch::optim::Optimizer& opt,
                                const TrainingState& state, const CheckpointFaults& faults) {
  std::string error;
  if (group.rank() == 0) {
    try {
      save_checkpoint(path, model, opt, state, faults);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  fail_together(group, error);  // also keeps every rank behind the checkpoint
}

TrainingState load_checkpoint_on_all_ranks(dtrain::ProcessGroup& group, const std::string& path,
                                           torch::nn::Module& model, torch::optim::Adam& opt) {
  std::optional<Checkpoint> checkpoint;
  std::string error;
  try {
    checkpoint.emplace(read_checkpoint(path, model, opt));
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(group, error);
  try {
    checkpoint->apply(model, opt);
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(group, error);  // no rank trains on when another could not apply it
  return checkpoint->state();
}
