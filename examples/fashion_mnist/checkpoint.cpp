#include "checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <dtrain/checkpoint/distributed.h>
#include <dtrain/errors.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace {

namespace ckpt = dtrain::checkpoint;

constexpr const char* kProgram = "dtrain-fashion-mnist/2";

// Names and shapes of everything the model saves, in order. Stored in the
// checkpoint so that one of another model is refused with both layouts.
std::string signature(torch::nn::Module& model) {
  std::ostringstream out;
  for (const auto& p : model.named_parameters()) out << p.key() << ":" << p.value().sizes() << ";";
  for (const auto& b : model.named_buffers()) out << b.key() << ":" << b.value().sizes() << ";";
  return out.str();
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

torch::optim::AdamOptions& adam_options(torch::optim::Adam& opt) {
  return static_cast<torch::optim::AdamOptions&>(opt.param_groups().at(0).options());
}

std::string exact(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", v);
  return text;
}

// --- loading: every check runs before anything is modified ------------------

[[noreturn]] void refuse(const std::string& what) { throw std::runtime_error(what); }

const std::string& entry(const std::map<std::string, std::string>& meta, const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) refuse("lacks '" + key + "'");
  return it->second;
}

int64_t counter(const std::map<std::string, std::string>& meta, const std::string& key, int64_t min,
                int64_t max) {
  const std::string& text = entry(meta, key);
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0) refuse("has a corrupt counter " + key + " \"" + text + "\"");
  if (v < min || v > max)
    refuse("has " + key + " = " + text + " (expected " + std::to_string(min) + " to " +
           std::to_string(max) + ")");
  return v;
}

double option(const std::map<std::string, std::string>& meta, const std::string& key) {
  const std::string& text = entry(meta, key);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v) || v < 0)
    refuse("has a bad optimizer option " + key + " \"" + text + "\"");
  return v;
}

// The program and the model it was written for.
void check_program(const std::map<std::string, std::string>& meta, torch::nn::Module& model) {
  auto program = meta.find("program");
  if (program == meta.end() || program->second != kProgram)
    refuse(std::string("is not a checkpoint of this program (program \"") +
           (program == meta.end() ? "" : program->second) + "\", expected \"" + kProgram + "\")");
  if (entry(meta, "model") != signature(model))
    refuse("was written for a different model (its parameters: " + entry(meta, "model") +
           "; this model's: " + signature(model) + ")");
}

// Exactly the entries this model and optimizer have (the loader checks
// their shapes and dtypes).
void check_entries(const ckpt::CheckpointInfo& info, const ckpt::DistributedState& live) {
  const std::set<std::string> saved(info.replicated.begin(), info.replicated.end());
  for (const auto& name : saved)
    if (!live.replicated.count(name)) refuse("has an unexpected entry " + name);
  for (const auto& [name, t] : live.replicated)
    if (!saved.count(name)) refuse("lacks the entry " + name);
  if (!info.sharded.empty()) refuse("has an unexpected sharded entry " + info.sharded.front());
}

TrainingState read_state(const std::map<std::string, std::string>& meta, int64_t dataset_size) {
  constexpr int64_t kMany = int64_t{1} << 50;
  TrainingState s;
  s.epoch = counter(meta, "epoch", 0, kMany);
  s.samples_in_epoch = counter(meta, "samples_in_epoch", 0, dataset_size);
  s.global_step = counter(meta, "global_step", 0, kMany);
  s.world_size = counter(meta, "world_size", 1, 1 << 20);
  return s;
}

// Adam's options as saved; amsgrad must match, since it decides which
// state tensors exist.
torch::optim::AdamOptions read_options(const std::map<std::string, std::string>& meta,
                                       const torch::optim::AdamOptions& mine) {
  const int64_t amsgrad = counter(meta, "adam/amsgrad", 0, 1);
  if ((amsgrad != 0) != mine.amsgrad())
    refuse(std::string("was written with Adam's amsgrad ") + (amsgrad ? "on" : "off") +
           "; this optimizer has it " + (mine.amsgrad() ? "on" : "off"));
  return torch::optim::AdamOptions(option(meta, "adam/lr"))
      .betas({option(meta, "adam/beta1"), option(meta, "adam/beta2")})
      .eps(option(meta, "adam/eps"))
      .weight_decay(option(meta, "adam/weight_decay"))
      .amsgrad(amsgrad != 0);
}

// What the loader cannot know: step counts are not negative, and the RNG
// state is one the generator accepts (tried on a generator of our own).
void check_values(const ckpt::DistributedState& staged) {
  for (const auto& [name, t] : staged.replicated) {
    const bool step = name.size() > 5 && name.compare(name.size() - 5, 5, "/step") == 0;
    if (step && t.item<int64_t>() < 0)
      refuse("has a bad optimizer state: " + name + " is " + std::to_string(t.item<int64_t>()));
  }
  try {
    auto scratch = at::make_generator<at::CPUGeneratorImpl>();
    scratch.set_state(staged.replicated.at("rng"));
  } catch (const c10::Error& e) {
    refuse(std::string("has an invalid RNG state: ") + e.what_without_backtrace());
  }
}

// "checkpoint <dir>: <why>" from the library -> "<why>".
std::string reason(const std::string& dir, const std::string& what) {
  const std::string prefix = "checkpoint " + dir + ": ";
  return what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what;
}

}  // namespace

const torch::optim::AdamParamState* adam_state(const torch::optim::Adam& opt,
                                               const torch::Tensor& param) {
  auto it = opt.state().find(state_key(opt.state(), param));
  if (it == opt.state().end()) return nullptr;
  return static_cast<const torch::optim::AdamParamState*>(it->second.get());
}

ckpt::DistributedState checkpoint_contents(torch::nn::Module& model, torch::optim::Adam& opt) {
  ckpt::DistributedState s;
  ckpt::add_module(s, model, "model/");
  ckpt::add_optimizer(s, opt, model, "optimizer/");
  s.replicated["rng"] = at::detail::getDefaultCPUGenerator().get_state();
  return s;
}

std::map<std::string, std::string> checkpoint_metadata(torch::nn::Module& model, torch::optim::Adam& opt,
                                                       const TrainingState& state) {
  const auto& o = adam_options(opt);
  return {{"program", kProgram},
          {"model", signature(model)},
          {"epoch", std::to_string(state.epoch)},
          {"samples_in_epoch", std::to_string(state.samples_in_epoch)},
          {"global_step", std::to_string(state.global_step)},
          {"world_size", std::to_string(state.world_size)},
          {"adam/lr", exact(o.lr())},
          {"adam/beta1", exact(std::get<0>(o.betas()))},
          {"adam/beta2", exact(std::get<1>(o.betas()))},
          {"adam/eps", exact(o.eps())},
          {"adam/weight_decay", exact(o.weight_decay())},
          {"adam/amsgrad", o.amsgrad() ? "1" : "0"}};
}

Checkpoint read_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Adam& opt,
                           int64_t dataset_size) {
  Checkpoint c;
  try {
    const auto live = checkpoint_contents(model, opt);  // creates Adam's (zero) state where it has none
    for (const auto& [name, t] : live.replicated) c.staged_.replicated[name] = at::empty_like(t);
    const auto info = ckpt::inspect(dir);
    check_program(info.metadata, model);
    c.options_ = read_options(info.metadata, adam_options(opt));
    check_entries(info, live);
    c.state_ = read_state(info.metadata, dataset_size);
    ckpt::load(dir, c.staged_);
    check_values(c.staged_);
  } catch (const std::exception& e) {
    throw std::runtime_error("cannot load checkpoint " + dir + ": " + reason(dir, e.what()));
  }
  return c;
}

void Checkpoint::apply(torch::nn::Module& model, torch::optim::Adam& opt) {
  auto live = checkpoint_contents(model, opt);
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : live.replicated) t.copy_(staged_.replicated.at(name));
  }
  for (const auto& put_back : live.after_load) put_back();  // Adam's step counts
  adam_options(opt) = options_;
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(staged_.replicated.at("rng"));
}
