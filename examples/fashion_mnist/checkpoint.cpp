#include "checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <dtrain/errors.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace {

using dtrain::checkpoint::TensorFile;

constexpr const char* kFormat = "dtrain-fashion-mnist-checkpoint/1";

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

std::string state_name(size_t k, const char* field) {
  return "optimizer/state/" + std::to_string(k) + "/" + field;
}
std::string group_name(size_t g, const char* field) {
  return "optimizer/group/" + std::to_string(g) + "/" + field;
}

// Optimizer::state() is keyed by the parameter's TensorImpl: as a string in
// libtorch 1.x, as the pointer itself in 2.x.
template <typename Map>
typename Map::key_type state_key(const Map&, const torch::Tensor& param) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream out;  // how libtorch 1.x spells it
    out << param.unsafeGetTensorImpl();
    return out.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

const torch::optim::AdamOptions& adam_options(const torch::optim::OptimizerParamGroup& group) {
  return static_cast<const torch::optim::AdamOptions&>(group.options());
}

// --- loading: every check runs before anything is modified ------------------

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw std::runtime_error("checkpoint " + path + " " + what);
}

// The validated file's entries, each taken at most once: what is left at
// the end was not expected.
class Entries {
 public:
  Entries(const std::string& path, TensorFile& file) : path_(path), file_(file) {}

  // The tensor, or undefined when absent.
  torch::Tensor find(const std::string& name) {
    auto it = file_.tensors.find(name);
    if (it == file_.tensors.end()) return {};
    taken_.insert(name);
    return it->second;
  }

  torch::Tensor counter(const std::string& name, int64_t min) {
    torch::Tensor t = find("state/" + name);
    if (!t.defined()) refuse(path_, "lacks the counter " + name);
    if (t.scalar_type() != torch::kLong || t.numel() != 1)
      refuse(path_, "has a corrupt counter " + name + " (" + describe(t) +
                        ", expected a single Long)");
    const int64_t v = t.item<int64_t>();
    if (v < min)
      refuse(path_, "has " + name + " = " + std::to_string(v) + " (expected at least " +
                        std::to_string(min) + ")");
    return t;
  }

  void expect_all_taken() const {
    for (const auto& [name, t] : file_.tensors)
      if (!taken_.count(name)) refuse(path_, "has an unexpected entry " + name);
  }

 private:
  const std::string& path_;
  TensorFile& file_;
  std::set<std::string> taken_;
};

void check_model(const std::string& path, torch::nn::Module& model, Entries& in) {
  auto check = [&](const std::string& name, const torch::Tensor& mine) {
    const torch::Tensor saved = in.find("model/" + name);
    if (!saved.defined()) refuse(path, "lacks the model tensor " + name);
    if (saved.scalar_type() != mine.scalar_type() || saved.sizes() != mine.sizes())
      refuse(path, "has the model tensor " + name + " as " + describe(saved) +
                       "; this model's is " + describe(mine));
  };
  for (const auto& p : model.named_parameters()) check(p.key(), p.value());
  for (const auto& b : model.named_buffers()) check(b.key(), b.value());
}

// Adam's per-parameter state, as Adam::step will use it against `param`.
std::string adam_state_problem(Entries& in, size_t k, const torch::Tensor& param, bool amsgrad) {
  const torch::Tensor step = in.find(state_name(k, "step"));
  if (step.scalar_type() != torch::kLong || step.numel() != 1)
    return "step is " + describe(step) + " (expected a single Long)";
  if (step.item<int64_t>() < 1)
    return "step is " + std::to_string(step.item<int64_t>()) + " (expected at least 1)";
  for (const char* field : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
    const torch::Tensor t = in.find(state_name(k, field));
    const bool needed = std::strcmp(field, "max_exp_avg_sq") != 0 || amsgrad;
    if (!needed && !t.defined()) continue;
    if (!t.defined() || t.scalar_type() != param.scalar_type() || t.sizes() != param.sizes())
      return std::string(field) + " is " + describe(t) + ", the parameter " + describe(param);
  }
  return "";
}

// The groups must hold as many parameters as `opt`'s; each parameter's
// state must fit it, as Adam::step will use it.
void check_optimizer(const std::string& path, torch::nn::Module& model,
                     const torch::optim::Adam& opt, Entries& in) {
  std::map<const void*, std::string> names;
  for (const auto& p : model.named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  size_t k = 0;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& params = opt.param_groups()[g].params();
    const torch::Tensor options = in.find(group_name(g, "options"));
    const torch::Tensor size = in.find(group_name(g, "size"));
    if (!options.defined() || !size.defined())
      refuse(path, "has no optimizer state for parameter group " + std::to_string(g));
    if (options.scalar_type() != torch::kDouble || options.dim() != 1 || options.size(0) != 6 ||
        size.scalar_type() != torch::kLong || size.numel() != 1)
      refuse(path, "has a corrupt optimizer state for parameter group " + std::to_string(g));
    if (size.item<int64_t>() != static_cast<int64_t>(params.size()))
      refuse(path, "has an optimizer state that does not fit this optimizer: parameter group " +
                       std::to_string(g) + " holds " + std::to_string(size.item<int64_t>()) +
                       " parameters in the checkpoint, " + std::to_string(params.size()) +
                       " here");
    const bool amsgrad = options[5].item<double>() != 0;
    for (size_t i = 0; i < params.size(); ++i, ++k) {
      if (!in.find(state_name(k, "step")).defined()) continue;  // never stepped
      const auto problem = adam_state_problem(in, k, params[i], amsgrad);
      if (problem.empty()) continue;
      auto name = names.find(params[i].unsafeGetTensorImpl());
      refuse(path, "has a bad optimizer state for " +
                       (name != names.end() ? name->second : "parameter " + std::to_string(k)) +
                       ": " + problem);
    }
  }
}

TrainingState read_state(Entries& in) {
  TrainingState s;
  s.epoch = in.counter("epoch", 0).item<int64_t>();
  s.step_in_epoch = in.counter("step_in_epoch", 0).item<int64_t>();
  s.global_step = in.counter("global_step", s.step_in_epoch).item<int64_t>();
  s.world_size = in.counter("world_size", 1).item<int64_t>();
  return s;
}

// Set on a generator of our own first: set_state checks the size and the
// dtype of the state, and the default generator is touched only in apply().
void check_rng(const std::string& path, Entries& in) {
  const torch::Tensor rng = in.find("rng");
  if (!rng.defined()) refuse(path, "lacks the RNG state");
  try {
    auto scratch = at::make_generator<at::CPUGeneratorImpl>();
    scratch.set_state(rng);
  } catch (const c10::Error& e) {
    refuse(path, "has an invalid RNG state (" + describe(rng) +
                     "): " + e.what_without_backtrace());
  }
}

}  // namespace

const torch::optim::AdamParamState* adam_state(const torch::optim::Adam& opt,
                                               const torch::Tensor& param) {
  auto it = opt.state().find(state_key(opt.state(), param));
  if (it == opt.state().end()) return nullptr;
  return static_cast<const torch::optim::AdamParamState*>(it->second.get());
}

TensorFile checkpoint_contents(torch::nn::Module& model, const torch::optim::Adam& opt,
                               const TrainingState& state) {
  TensorFile f;
  f.metadata["format"] = kFormat;
  f.metadata["model/signature"] = signature(model);
  for (const auto& p : model.named_parameters()) f.tensors["model/" + p.key()] = p.value();
  for (const auto& b : model.named_buffers()) f.tensors["model/" + b.key()] = b.value();
  size_t k = 0;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& group = opt.param_groups()[g];
    const auto& o = adam_options(group);
    f.tensors[group_name(g, "options")] =
        torch::tensor({o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                       o.weight_decay(), o.amsgrad() ? 1.0 : 0.0}, torch::kDouble);
    f.tensors[group_name(g, "size")] = scalar(static_cast<int64_t>(group.params().size()));
    for (const auto& p : group.params()) {
      if (const auto* s = adam_state(opt, p)) {
        f.tensors[state_name(k, "step")] = scalar(s->step());
        f.tensors[state_name(k, "exp_avg")] = s->exp_avg();
        f.tensors[state_name(k, "exp_avg_sq")] = s->exp_avg_sq();
        if (s->max_exp_avg_sq().defined())
          f.tensors[state_name(k, "max_exp_avg_sq")] = s->max_exp_avg_sq();
      }
      ++k;
    }
  }
  f.tensors["state/epoch"] = scalar(state.epoch);
  f.tensors["state/step_in_epoch"] = scalar(state.step_in_epoch);
  f.tensors["state/global_step"] = scalar(state.global_step);
  f.tensors["state/world_size"] = scalar(state.world_size);
  f.tensors["rng"] = at::detail::getDefaultCPUGenerator().get_state();
  return f;
}

void save_checkpoint(const std::string& path, torch::nn::Module& model,
                     const torch::optim::Adam& opt, const TrainingState& state,
                     const CheckpointFaults& faults) {
  const TensorFile contents = checkpoint_contents(model, opt, state);
  try {
    dtrain::checkpoint::save_tensor_file(path, contents, faults);
  } catch (const dtrain::Error& e) {
    // "cannot save tensor file <path>: <step>" -> "cannot save checkpoint <path>: <step>"
    const std::string prefix = "cannot save tensor file " + path + ": ";
    std::string step = e.what();
    if (step.compare(0, prefix.size(), prefix) == 0) step.erase(0, prefix.size());
    throw std::runtime_error("cannot save checkpoint " + path + ": " + step);
  }
}

Checkpoint read_checkpoint(const std::string& path, torch::nn::Module& model,
                           const torch::optim::Adam& opt) {
  if (::access(path.c_str(), R_OK) != 0) refuse(path, "does not exist or is not readable");
  Checkpoint c;
  c.path_ = path;
  try {
    c.file_ = dtrain::checkpoint::load_tensor_file(path);
  } catch (const dtrain::InvalidArgument& e) {
    refuse(path, std::string("is truncated or corrupt: ") + e.what());
  }
  const auto meta = [&](const char* key) {
    auto it = c.file_.metadata.find(key);
    return it == c.file_.metadata.end() ? std::string() : it->second;
  };
  if (meta("format") != kFormat)
    refuse(path, "is not a checkpoint of this program (format \"" + meta("format") +
                     "\", expected \"" + kFormat + "\")");
  if (meta("model/signature") != signature(model))
    refuse(path, "was written for a different model (its parameters: " + meta("model/signature") +
                     "; this model's: " + signature(model) + ")");
  Entries in(path, c.file_);
  check_model(path, model, in);
  check_optimizer(path, model, opt, in);
  c.state_ = read_state(in);
  check_rng(path, in);
  in.expect_all_taken();
  return c;
}

void Checkpoint::apply(torch::nn::Module& model, torch::optim::Adam& opt) {
  const auto& t = file_.tensors;
  try {
    torch::NoGradGuard no_grad;
    for (auto& p : model.named_parameters()) p.value().copy_(t.at("model/" + p.key()));
    for (auto& b : model.named_buffers()) b.value().copy_(t.at("model/" + b.key()));
    size_t k = 0;
    for (size_t g = 0; g < opt.param_groups().size(); ++g) {
      auto& group = opt.param_groups()[g];
      const auto o = t.at(group_name(g, "options"));
      auto& options = static_cast<torch::optim::AdamOptions&>(group.options());
      options.lr(o[0].item<double>())
          .betas({o[1].item<double>(), o[2].item<double>()})
          .eps(o[3].item<double>())
          .weight_decay(o[4].item<double>())
          .amsgrad(o[5].item<double>() != 0);
      for (const auto& p : group.params()) {
        const auto key = state_key(opt.state(), p);
        auto saved = [&](const char* field) {
          auto it = t.find(state_name(k, field));
          return it == t.end() ? torch::Tensor() : it->second.to(p.device(), false, true);
        };
        if (t.count(state_name(k, "step")) == 0) {
          opt.state().erase(key);
        } else {
          auto s = std::make_unique<torch::optim::AdamParamState>();
          s->step(t.at(state_name(k, "step")).item<int64_t>());
          s->exp_avg(saved("exp_avg"));
          s->exp_avg_sq(saved("exp_avg_sq"));
          if (auto m = saved("max_exp_avg_sq"); m.defined()) s->max_exp_avg_sq(m);
          opt.state()[key] = std::move(s);
        }
        ++k;
      }
    }
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(t.at("rng"));
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
