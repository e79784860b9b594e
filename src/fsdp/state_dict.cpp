// FSDPCore outside the training step: full state dicts, loading them into
// the shards, gradient clipping over the whole model, summoning the full
// parameters.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <limits>
#include <set>

#include "common/enforce.h"
#include "fsdp/core_impl.h"

namespace dtrain::detail {

std::map<std::string, at::Tensor> FSDPCore::full_state_dict(bool rank0_only) {
  auto& s = *impl_;
  DTRAIN_CHECK_ARG(!rank0_only || s.options.submodule_groups().empty(),
                   "FullyShardedDataParallel::full_state_dict: rank0_only with submodule_groups would "
                   "leave out the parts other ranks hold (their experts); take each rank's "
                   "(rank0_only=false) or save a distributed checkpoint");
  at::NoGradGuard no_grad;
  const bool keep = !rank0_only || (s.group->rank() == 0 && (!s.replicate || s.replicate->rank() == 0));
  std::map<std::string, at::Tensor> out;
  for (auto& unit : s.units) {
    auto values = unit->gather_master();
    if (!keep) continue;
    for (size_t i = 0; i < values.size(); ++i)
      out[unit->param_names()[i]] = values[i].to(at::kCPU).clone();
  }
  if (keep)
    for (size_t i = 0; i < s.buffers.size(); ++i)
      out[s.buffer_names[i]] = s.buffers[i].detach().to(at::kCPU).clone();
  return out;
}

void FSDPCore::load_full_state_dict(const std::map<std::string, at::Tensor>& state) {
  auto& s = *impl_;
  const char* const who = "FullyShardedDataParallel::load_full_state_dict";
  std::set<std::string> expected(s.buffer_names.begin(), s.buffer_names.end());
  auto lookup = [&](const std::string& name, const at::Tensor& like) {
    auto it = state.find(name);
    DTRAIN_CHECK_ARG(it != state.end() && it->second.defined(), who, ": '", name,
                     "' is missing from the state");
    DTRAIN_CHECK_ARG(it->second.sizes() == like.sizes(), who, ": '", name, "' has shape ",
                     it->second.sizes(), " in the state but ", like.sizes(), " in the module");
    return it->second;
  };
  std::vector<std::vector<at::Tensor>> values;
  for (const auto& unit : s.units) {
    values.emplace_back();
    for (size_t i = 0; i < unit->params().size(); ++i) {
      expected.insert(unit->param_names()[i]);
      values.back().push_back(lookup(unit->param_names()[i], unit->params()[i]));
    }
  }
  for (size_t i = 0; i < s.buffers.size(); ++i) lookup(s.buffer_names[i], s.buffers[i]);
  for (const auto& item : state)
    DTRAIN_CHECK_ARG(expected.count(item.first), who, ": the state has '", item.first,
                     "', which the module does not");
  // Checked in full before anything changes.
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < s.units.size(); ++u) {
    s.units[u]->reshard();
    s.units[u]->load_full(values[u]);
  }
  for (size_t i = 0; i < s.buffers.size(); ++i) s.buffers[i].copy_(state.at(s.buffer_names[i]));
}

double FSDPCore::clip_grad_norm(double max_norm, double norm_type) {
  auto& s = *impl_;
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  DTRAIN_CHECK_ARG(inf || norm_type == 2.0,
                   "FullyShardedDataParallel::clip_grad_norm_: norm_type must be 2 or infinity, got ",
                   norm_type);
  DTRAIN_CHECK_ARG(max_norm >= 0, "FullyShardedDataParallel::clip_grad_norm_: max_norm must not be "
                                  "negative, got ", max_norm);
  at::NoGradGuard no_grad;
  double local = 0;
  for (const auto& unit : s.units) {
    const auto& grad = unit->shard().grad();
    if (!grad.defined()) continue;
    if (inf)
      local = std::max(local, grad.abs().max().item<double>());
    else
      local += grad.to(at::kDouble).square().sum().item<double>();
  }
  auto total = at::full({1}, local, at::TensorOptions().dtype(at::kDouble));
  if (s.group->size() > 1)
    s.group->all_reduce(total, inf ? ReduceOp::MAX : ReduceOp::SUM)->wait();
  const double norm = inf ? total.item<double>() : std::sqrt(total.item<double>());
  const double coef = max_norm / (norm + 1e-6);  // torch.nn.utils.clip_grad_norm_'s rule
  if (coef < 1)
    for (const auto& unit : s.units)
      if (unit->shard().grad().defined()) unit->shard().grad().mul_(coef);
  return norm;
}

void FSDPCore::gather_all() {
  for (auto& unit : impl_->units) unit->start_gather();
  for (auto& unit : impl_->units) unit->wait_gathered();
}

void FSDPCore::reshard_all(bool writeback) {
  for (auto& unit : impl_->units) unit->reshard(writeback);
}

}  // namespace dtrain::detail
