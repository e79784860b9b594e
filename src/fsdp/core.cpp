// FSDPCore: how FullyShardedDataParallel finds its units in the module
// tree and schedules their gathers, frees and gradient reductions around
// forward and backward.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "common/cpu_memory.h"
#include "common/enforce.h"
#include "ddp/model_sync.h"
#include "dtrain/distributed.h"
#include "dtrain/fsdp.h"
#include "fsdp/core_impl.h"

namespace dtrain::detail {
namespace {

std::string parent_path(const std::string& path) {
  const auto dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

std::string joined(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

// Every parameter's unit: the nearest enclosing FullyShard module or
// module named in submodule_groups (the root unit "" for the rest); units
// in the module tree's pre-order, the root first: the same on every rank.
struct Ownership {
  struct Owned {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
  };
  std::vector<std::string> owners{""};
  std::unordered_map<std::string, Owned> owned;
  std::unordered_map<std::string, FSDPModule*> unit_module;
  // A submodule_groups module without hooks: the FullyShard module (or
  // the root, "") whose forward gathers and frees it.
  std::unordered_map<std::string, std::string> host_of;

  Ownership(torch::nn::Module& model, const FSDPOptions::SubmoduleGroups& listed) {
    std::unordered_map<std::string, std::string> owner_of_module, hook_owner_of_module;
    std::unordered_map<const c10::TensorImpl*, std::pair<std::string, std::string>> seen;
    for (const auto& item : model.named_modules("", /*include_self=*/true)) {
      const std::string& path = item.key();
      auto* unit = path.empty() ? nullptr : dynamic_cast<FSDPModule*>(item.value().get());
      const bool own = unit != nullptr || (!path.empty() && listed.count(path) != 0);
      const std::string parent = parent_path(path);
      const std::string owner = own ? path : owner_of_module[parent];
      owner_of_module[path] = owner;
      hook_owner_of_module[path] = unit ? path : hook_owner_of_module[parent];
      if (own) owners.push_back(path);
      if (unit) unit_module[path] = unit;
      if (own && !unit) host_of[path] = hook_owner_of_module[parent];
      for (const auto& param : item.value()->named_parameters(/*recurse=*/false)) {
        const std::string name = joined(path, param.key());
        auto [it, fresh] = seen.emplace(param.value().unsafeGetTensorImpl(), std::make_pair(owner, name));
        if (!fresh) {
          DTRAIN_CHECK_ARG(it->second.first == owner, "FullyShardedDataParallel: parameter '", name,
                           "' is also '", it->second.second, "': one parameter shared by units '",
                           it->second.first, "' and '", owner,
                           "' cannot be sharded (put the modules sharing it in one unit)");
          continue;
        }
        owned[owner].params.push_back(param.value());
        owned[owner].names.push_back(name);
      }
    }
  }
};

}  // namespace

void FSDPCore::attach(FSDPModule& module, FSDPCore* core) { module.core_ = core; }

void FSDPCore::Impl::build_units(torch::nn::Module& model, FSDPCore* core) {
  check_submodule_groups(model);
  const auto& listed = options.submodule_groups();
  Ownership own(model, listed);
  auto on_grad = [this](fsdp::FlatUnit& unit, size_t index) { grad_ready(unit, index); };
  for (const auto& owner : own.owners) {
    auto found_module = own.unit_module.find(owner);
    auto* module = found_module == own.unit_module.end() ? nullptr : found_module->second;
    if (module) {
      FSDPCore::attach(*module, core);
      attached.push_back(module);
    }
    auto found = own.owned.find(owner);
    if (found == own.owned.end() || found->second.params.empty()) continue;
    const auto hosted = own.host_of.find(owner);
    const FSDPModule* host = module;
    if (hosted != own.host_of.end()) host = hosted->second.empty() ? nullptr : own.unit_module.at(hosted->second);
    units_of[host].push_back(units.size());
    auto& [params, names] = found->second;
    const auto listed_group = owner.empty() ? listed.end() : listed.find(owner);
    ProcessGroup& over = listed_group == listed.end() ? *group : *listed_group->second;
    auto unit = module && module->constructed_
                    ? adopt(*module, owner, params, std::move(names), over)
                    : std::make_shared<fsdp::FlatUnit>(owner, std::move(params), std::move(names), over);
    unit->configure(options.mixed_precision(), on_grad);
    if (replicate) unit->replicate_over(*replicate);
    if (options.replicate_average()) unit->replicate_with(options.replicate_average());
    units.push_back(std::move(unit));
  }
}

void FSDPCore::Impl::check_submodule_groups(torch::nn::Module& model) const {
  const auto& listed = options.submodule_groups();
  if (listed.empty()) return;
  DTRAIN_CHECK_ARG(!replicate && !options.replicate_average(), "FullyShardedDataParallel: "
                   "submodule_groups with HSDP (a 2-D mesh or replicate_average) is not supported");
  std::unordered_set<std::string> paths;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) paths.insert(item.key());
  for (const auto& [path, over] : listed) {
    DTRAIN_CHECK_ARG(paths.count(path) != 0, "FullyShardedDataParallel: submodule_groups names '", path,
                     "', which is not a submodule of the model (named_modules() gives its paths)");
    DTRAIN_CHECK_ARG(over != nullptr, "FullyShardedDataParallel: submodule_groups gives '", path,
                     "' no group");
    DTRAIN_CHECK_ARG(over->rank() >= 0, "FullyShardedDataParallel: submodule_groups shards '", path,
                     "' over group '", over->name(), "', which this rank is not a member of");
  }
}

std::shared_ptr<fsdp::FlatUnit> FSDPCore::Impl::adopt(FSDPModule& module, const std::string& path,
                                                      const std::vector<at::Tensor>& params,
                                                      std::vector<std::string> names, const ProcessGroup& over) {
  const auto& built_over = module.constructed_group_;
  DTRAIN_CHECK_ARG(built_over.get() == &over, "FullyShardedDataParallel: unit '", path,
                   "' was sharded at construction over group '", built_over->name(),
                   "', not over group '", over.name(), "', which FullyShardedDataParallel shards it over");
  const auto& built = module.constructed_->params();
  bool same = built.size() == params.size();
  for (size_t i = 0; same && i < params.size(); ++i) same = built[i].is_same(params[i]);
  DTRAIN_CHECK_ARG(same, "FullyShardedDataParallel: unit '", path, "' has other parameters than "
                   "when it was sharded at construction (parameters registered after its "
                   "constructor cannot join its shards)");
  auto unit = std::move(module.constructed_);
  module.constructed_group_.reset();
  unit->rename(path, std::move(names));
  return unit;
}

void FSDPCore::Impl::resolve_groups() {
  if (!options.mesh()) {
    group = options.process_group() ? options.process_group() : default_group();
    return;
  }
  const DeviceMesh& mesh = *options.mesh();
  DTRAIN_CHECK_ARG(!options.process_group(), "FullyShardedDataParallel: give FSDPOptions a "
                   "process_group or a mesh, not both");
  DTRAIN_CHECK_ARG(!options.replicate_average(), "FullyShardedDataParallel: give FSDPOptions a "
                   "replicate_average with the process_group of one replica, not with a mesh");
  std::string shape;
  for (int n : mesh.shape()) shape += (shape.empty() ? "" : " x ") + std::to_string(n);
  DTRAIN_CHECK_ARG(mesh.ndim() == 1 || mesh.ndim() == 2, "FullyShardedDataParallel: a mesh of ",
                   shape, " has ", mesh.ndim(), " dimensions; FSDP takes 1 (shard) or 2 "
                   "(replicate, shard: HSDP); slice it first (mesh[{\"dp_replicate\", \"dp_shard\"}])");
  group = mesh.get_group(mesh.ndim() - 1);
  if (mesh.ndim() == 2) replicate = mesh.get_group(0);
}

FSDPCore::FSDPCore(torch::nn::Module& model, const FSDPOptions& options)
    : impl_(std::make_unique<Impl>()) {
  // The heap keeps blocks below 32 MiB; larger ones (a layer's gradient,
  // FSDP's own buffers are mapped anyway) go back to the system.
  return_large_blocks(32 << 20);
  auto& s = *impl_;
  s.options = options;
  s.resolve_groups();
  DTRAIN_CHECK_ARG(s.group->rank() >= 0, "FullyShardedDataParallel: this rank is not a member of group '",
                   s.group->name(), "'");
  const auto& mp = options.mixed_precision();
  for (const auto& dtype : {mp.param_dtype(), mp.reduce_dtype()})
    DTRAIN_CHECK_ARG(!dtype || at::isFloatingType(*dtype),
                     "FullyShardedDataParallel: mixed precision dtypes must be floating point, got ",
                     *dtype);
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    names.push_back(item.key());
    tensors.push_back(item.value());
  }
  DTRAIN_CHECK_ARG(!tensors.empty(), "FullyShardedDataParallel: the module has no parameters");
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    names.push_back(item.key());
    tensors.push_back(item.value());
    s.buffer_names.push_back(item.key());
    s.buffers.push_back(item.value());
  }
  // Buffers: shard rank 0's, then replica 0's, so every rank has rank
  // (0, 0)'s; the units' shards follow the same way (build_units).
  for (auto* g : {s.group.get(), s.replicate.get()}) {
    if (g == nullptr) continue;
    ddp::verify_same_model(*g, names, tensors, "FullyShardedDataParallel");
    if (!s.buffers.empty() && g->size() > 1) ddp::broadcast_coalesced(*g, s.buffers, 0);
  }
  s.build_units(model, this);
  s.ran_forward.assign(s.units.size(), false);
}

FSDPCore::~FSDPCore() {
  for (auto* module : impl_->attached) attach(*module, nullptr);
}

void FSDPCore::before_forward(const FSDPModule* module) {
  auto& s = *impl_;
  if (module == nullptr && !s.microbatching) s.begin_iteration();
  const auto& indices = s.indices_of(module);
  if (indices.empty()) return;
  for (size_t index : indices) {
    if (!s.ran_forward[index]) {
      s.ran_forward[index] = true;
      s.forward_order.push_back(index);
    }
    s.gather(index, /*ahead=*/false);
  }
  for (size_t index : indices) s.units[index]->wait_gathered();
  if (s.options.forward_prefetch()) s.prefetch_after(s.last_forward_order, indices.back());
}

void FSDPCore::after_forward(const FSDPModule* module, const std::vector<at::Tensor>& outputs) {
  auto& s = *impl_;
  const bool grad_mode = at::GradMode::is_enabled();
  const auto& indices = s.indices_of(module);
  if (!indices.empty()) {
    bool needs_backward = false;
    for (const auto& out : outputs) {
      if (!grad_mode || !out.defined() || !out.requires_grad()) continue;
      needs_backward = true;
      out.register_hook([impl = impl_.get(), indices](const at::Tensor&) { impl->pre_backward(indices); });
    }
    // A result with no visible tensor may still lead backward into the
    // unit: its parameters stay until the end of backward.
    const bool unknown = grad_mode && outputs.empty();
    const bool keep = unknown || (needs_backward && (module == nullptr ||
                                                     !s.options.reshard_after_forward()));
    if (needs_backward || unknown) s.expect_backward = true;
    if (!keep)
      for (size_t index : indices) s.units[index]->reshard();
  }
  if (module == nullptr) {
    s.last_forward_order = s.forward_order;
    if (!s.expect_backward) s.end_iteration();
  }
}

at::Tensor FSDPCore::cast_input(const at::Tensor& input) const {
  const auto& dtype = impl_->options.mixed_precision().param_dtype();
  if (!dtype || !input.defined() || !at::isFloatingType(input.scalar_type())) return input;
  return input.to(*dtype);
}

std::vector<at::Tensor> FSDPCore::shards() const {
  std::vector<at::Tensor> out;
  for (const auto& unit : impl_->units) out.push_back(unit->shard());
  return out;
}

std::vector<FSDPShard> FSDPCore::shard_layout() const {
  std::vector<FSDPShard> out;
  for (const auto& unit : impl_->units) {
    FSDPShard s;
    s.unit = unit->name();
    s.shard = unit->shard();
    s.offset = unit->shard_offset();
    s.numel = unit->numel();
    s.param_names = unit->param_names();
    for (const auto& p : unit->params()) s.param_shapes.push_back(p.sizes().vec());
    s.param_offsets = unit->param_offsets();
    s.group = &unit->group();
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::string> FSDPCore::unit_names() const {
  std::vector<std::string> out;
  for (const auto& unit : impl_->units) out.push_back(unit->name());
  return out;
}

FSDPStats FSDPCore::stats() const { return impl_->last; }
void FSDPCore::set_sync(bool enabled) { impl_->sync = enabled; }
bool FSDPCore::sync_enabled() const { return impl_->sync; }
ProcessGroup& FSDPCore::group() const { return *impl_->group; }
ProcessGroup* FSDPCore::replicate_group() const { return impl_->replicate.get(); }

void FSDPCore::begin_microbatches() {
  impl_->begin_iteration();
  impl_->microbatching = true;
}

void FSDPCore::end_microbatches() {
  auto& s = *impl_;
  s.microbatching = false;
  if (s.expect_backward || s.backward_running) s.end_iteration();  // a step that failed
}

// ---- the iteration ---------------------------------------------------------

const std::vector<size_t>& FSDPCore::Impl::indices_of(const FSDPModule* module) const {
  static const std::vector<size_t> none;
  auto it = units_of.find(module);
  return it == units_of.end() ? none : it->second;
}

void FSDPCore::Impl::begin_iteration() {
  // A forward whose backward never ran (or failed) leaves units gathered
  // and reductions in flight: settle them before starting over.
  if (expect_backward || backward_running) end_iteration();
  forward_order.clear();
  ran_forward.assign(units.size(), false);
  current = FSDPStats();
}

void FSDPCore::Impl::prefetch_after(const std::vector<size_t>& order, size_t index) {
  auto it = std::find(order.begin(), order.end(), index);
  if (it == order.end() || ++it == order.end()) return;
  if (!units[*it]->reduced()) gather(*it, /*ahead=*/true);
}

void FSDPCore::Impl::gather(size_t index, bool ahead) {
  auto& unit = *units[index];
  if (unit.gathered()) return;
  unit.start_gather();
  ++current.all_gathers;
  if (ahead) ++current.prefetched;
  int64_t held = 0;
  for (const auto& u : units) held += u->gathered() ? u->full_bytes() : 0;
  current.peak_gathered_bytes = std::max(current.peak_gathered_bytes, held);
}

void FSDPCore::Impl::queue_finalize() {
  if (backward_running) return;
  backward_running = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
}

void FSDPCore::Impl::pre_backward(const std::vector<size_t>& indices) {
  if (!expect_backward) return;
  queue_finalize();
  std::vector<size_t> pending;
  for (size_t index : indices) {
    if (std::find(backward_order.begin(), backward_order.end(), index) == backward_order.end())
      backward_order.push_back(index);
    if (!units[index]->reduced()) pending.push_back(index);  // else reached after its gradients were reduced
  }
  if (pending.empty()) return;
  settle_reductions(/*wait=*/false);  // free what is done before gathering more
  for (size_t index : pending) gather(index, /*ahead=*/false);
  for (size_t index : pending) units[index]->wait_gathered();
  if (options.backward_prefetch()) prefetch_after(last_backward_order, indices.back());
}

void FSDPCore::Impl::grad_ready(fsdp::FlatUnit& unit, size_t index) {
  if (!expect_backward) return;  // a backward that no FSDP forward prepared
  queue_finalize();
  if (unit.count_grad(index) && !unit.reduced()) {
    unit.reshard();  // its full parameters are no longer needed: free them before the flat gradient
    reduce(unit);
  }
}

// A unit's flat gradient lives until its reduce-scatter ends. Before a
// unit builds its flat gradient, the one reduce-scatter still in flight is
// finished (usually done by then: it ran while this unit's backward
// computed), so backward holds one unit's gradients in reduction besides
// the unit being reduced, not the model's.
void FSDPCore::Impl::reduce(fsdp::FlatUnit& unit) {
  if (sync) {
    ++current.reduce_scatters;
    settle_reductions(/*wait=*/true);
  }
  unit.reduce(sync);
  int64_t held = 0;
  for (const auto& u : units) held += u->gradient_bytes();
  current.peak_gradient_bytes = std::max(current.peak_gradient_bytes, held);
  if (sync) reducing.push_back(&unit);
}

// Finishes the reduce-scatters in flight (with wait), or those already
// complete (without): their flat gradients are freed at once.
void FSDPCore::Impl::settle_reductions(bool wait) {
  while (!reducing.empty() && (wait || reducing.front()->reduce_complete())) {
    reducing.front()->finish_reduce();
    reducing.erase(reducing.begin());
  }
}

// End of backward: units whose parameters did not all get gradients are
// reduced now (missing ones count as zero), in reverse forward order.
// Between microbatches (pipelining, sync off), the units are resharded
// and ready for the next microbatch's backward, whose forward already ran.
void FSDPCore::Impl::finish_backward() {
  for (auto it = forward_order.rbegin(); it != forward_order.rend(); ++it) {
    auto& unit = *units[*it];
    if (unit.trainable() && !unit.reduced()) reduce(unit);
  }
  last_backward_order = backward_order;
  if (microbatching && !sync) {
    for (auto& unit : units) {
      unit->reshard();
      unit->reset_iteration();
    }
    backward_order.clear();
    backward_running = false;
    return;
  }
  end_iteration();
  current.iteration = last.iteration + 1;
  current.shard_bytes = 0;
  for (const auto& unit : units) current.shard_bytes += unit->shard().nbytes();
  last = current;
  current = FSDPStats();
}

void FSDPCore::Impl::end_iteration() {
  reducing.clear();
  for (auto& unit : units) {
    unit->finish_reduce();
    unit->reshard();
    unit->reset_iteration();
  }
  backward_order.clear();
  expect_backward = false;
  backward_running = false;
}

}  // namespace dtrain::detail
