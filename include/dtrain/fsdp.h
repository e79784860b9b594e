#pragma once

// FullyShardedDataParallel (ZeRO stage 3; PyTorch's FSDP / fully_shard):
// parameters, gradients and optimizer state are split across the ranks of
// a group, so each rank stores 1/N of them, and a unit's full parameters
// exist only while that unit computes.
//
// libtorch modules have no forward hooks, so the units are declared in the
// model's type: a submodule of type FullyShard<Impl> (Impl itself with
// FSDP's behaviour mixed in, the C++ form of what fully_shard() does to a
// Python module's class) is one unit. Its parameter names stay Impl's.
//
//   struct NetImpl : torch::nn::Module {
//     NetImpl() {
//       for (int i = 0; i < 4; ++i)
//         blocks.push_back(register_module("block" + std::to_string(i),
//                                          std::make_shared<dtrain::FullyShard<BlockImpl>>(512)));
//       head = register_module("head", torch::nn::Linear(512, 10));
//     }
//     torch::Tensor forward(torch::Tensor x) {
//       for (auto& b : blocks) x = b->forward(x);    // gathers, runs, frees
//       return head(x);
//     }
//     std::vector<std::shared_ptr<dtrain::FullyShard<BlockImpl>>> blocks;
//     torch::nn::Linear head{nullptr};
//   };
//   dtrain::FullyShardedDataParallel fsdp(std::make_shared<NetImpl>());
//   torch::optim::Adam opt(fsdp.parameters(), 1e-3);   // this rank's shards
//   loss_fn(fsdp.forward(x), y).backward();             // grads reduce-scattered
//   opt.step();
//
// How it works. The parameters of each unit (not those of units nested in
// it) form one flat buffer, cut into N equal shards of ceil(numel / N)
// elements; the parameters the root module owns outside any unit form the
// root unit. A rank keeps its shard of each unit as one tensor, the
// "flat parameter" its optimizer steps on (fsdp.parameters()). Before a
// unit's forward its full buffer is all-gathered and the module's own
// parameters become views of it; after the forward it is freed
// (reshard_after_forward), gathered again when the gradient reaches the
// unit's outputs in backward, and freed once every parameter of the unit
// has its gradient, which is then reduce-scattered (averaged) into the
// shard's .grad. With forward/backward prefetch the next unit's all-gather
// (in the order recorded in the previous iteration) runs while the current
// unit computes. Outside forward and backward the module's parameters hold
// no memory: read them through full_state_dict() or summon_full_params().
//
// Results. With element-wise optimizers (SGD with momentum, Adam, AdamW,
// ...) training equals DDP with the same optimizer over all parameters.
// Requirements (InvalidArgument otherwise): within a unit, one dtype, one
// device, and the same requires_grad for every parameter; a parameter
// belongs to one unit only. Every rank runs the same units in the same
// order (as with DDP, every rank must use the same parameters). Do not
// move the module (to()) after wrapping it.

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/device_mesh.h"
#include "dtrain/no_sync_guard.h"
#include "dtrain/process_group.h"

namespace dtrain {

// Mixed precision (PyTorch's MixedPrecision): the shards the optimizer
// steps on keep the parameters' dtype (fp32 master weights); forward and
// backward compute in param_dtype, and gradients are reduce-scattered in
// reduce_dtype (param_dtype when unset) before being cast back.
struct MixedPrecision {
  DTRAIN_ARG(c10::optional<at::ScalarType>, param_dtype) = c10::nullopt;
  DTRAIN_ARG(c10::optional<at::ScalarType>, reduce_dtype) = c10::nullopt;
};

struct FSDPOptions {
  using SubmoduleGroups = std::map<std::string, std::shared_ptr<ProcessGroup>>;  // (submodule_groups)
  // The group the parameters are sharded over; null: the default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  // Instead of process_group, as FSDP2's fully_shard(mesh=...): a 1-D mesh
  // shards over its group; a 2-D mesh is HSDP, replicating along dimension
  // 0 and sharding along dimension 1 (typically: hosts x GPUs or ranks in a
  // host). Each replica holds the whole model in shards; gradients are
  // reduce-scattered inside the replica, then the shards' gradients are
  // all-reduced across replicas, so only 1/shard-size of them crosses
  // between replicas, and all-gathers stay inside.
  DTRAIN_ARG(c10::optional<DeviceMesh>, mesh) = c10::nullopt;
  // HSDP's average across replicas, done by another: the parameters are
  // sharded over process_group (one replica) as usual, and each unit's
  // reduce-scattered gradient shard, averaged over that group, is handed
  // to this function, which averages it across the replicas in place and
  // returns a Work that finishes once it has. FSDP goes on meanwhile (the
  // overlap stays) and waits on it before setting the shard's gradient; a
  // Work that fails fails the backward, as a failed collective does.
  // Fault tolerance's is ft::replicate_average(manager): the replicas live
  // in this step, the average recorded and never thrown on an error
  // (torchft's HSDP over its managed process group). No broadcast at
  // construction (the manager's init_sync does that). Not with a mesh.
  using ReplicaAverage = std::function<WorkPtr(at::Tensor)>;
  DTRAIN_ARG(ReplicaAverage, replicate_average) = nullptr;
  // Parts of the model sharded over groups of their own, as FSDP2's
  // fully_shard(module, mesh=...) applied to a submodule before the whole
  // model: module path (as named_modules() says it) -> group. The named
  // module's parameters (minus those of units nested in it) form a unit
  // sharded over that group, its gradients averaged over it. A
  // FullyShard<Impl> module is gathered and freed on its own schedule; any
  // other module (it has no forward hooks) with the unit that encloses it.
  // Expert parallelism's use: each MoE layer's experts over the
  // data-parallel ranks that hold the same experts, the rest of the model
  // over all of them (torchtitan's efsdp). Each group's ranks must be
  // among FSDP's group's, and ranks outside a group must hold other
  // parameters there (other experts): clip_grad_norm_ counts each rank's
  // shards once over FSDP's group. Not with HSDP (a 2-D mesh or
  // replicate_average).
  DTRAIN_ARG(SubmoduleGroups, submodule_groups) = {};
  // Free a unit's full parameters after its forward (ZeRO-3); false keeps
  // them until its gradients are reduced (SHARD_GRAD_OP, ZeRO-2-like).
  DTRAIN_ARG(bool, reshard_after_forward) = true;
  // Start the next unit's all-gather while the current unit computes.
  DTRAIN_ARG(bool, forward_prefetch) = true;
  DTRAIN_ARG(bool, backward_prefetch) = true;
  DTRAIN_ARG(MixedPrecision, mixed_precision) = MixedPrecision();
};

// What the last iteration (forward and backward) did on this rank.
struct FSDPStats {
  int64_t iteration = 0;            // backward passes completed
  int64_t all_gathers = 0;          // full parameters of a unit gathered
  int64_t prefetched = 0;           // ... of them started ahead, while another unit computed
  int64_t reduce_scatters = 0;      // units' gradients reduced into the shards
  int64_t peak_gathered_bytes = 0;  // most full-parameter memory held at once
  int64_t peak_gradient_bytes = 0;  // most unsharded gradient buffers held at once
                                    // (being reduce-scattered, or kept by no_sync)
  int64_t shard_bytes = 0;          // this rank's shards (what it keeps between iterations)
};

// Where this rank's shard of a unit lies: `shard`'s first element is
// element `offset` of the unit's flat parameters (`numel` of them, padding
// not counted).
struct FSDPShard {
  std::string unit;  // its module path; "" is the root unit
  at::Tensor shard;
  int64_t offset = 0, numel = 0;
  // The unit's parameters: their names in the whole model, their shapes,
  // and where each begins in the unit's flat parameters; and the group the
  // unit is sharded over (checkpoint::add_fsdp of tensor-parallel layers
  // gathers the whole of each parameter over it).
  std::vector<std::string> param_names;
  std::vector<std::vector<int64_t>> param_shapes;
  std::vector<int64_t> param_offsets;
  ProcessGroup* group = nullptr;
};

class FSDPModule;
namespace fsdp {
class FlatUnit;  // src/fsdp/flat_unit.h
}

namespace detail {

template <typename T>
struct IsPair : std::false_type {};
template <typename A, typename B>
struct IsPair<std::pair<A, B>> : std::true_type {};

// Every tensor in a forward's result: a tensor, or tuples, pairs and
// vectors of them; other types contribute none.
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& value, std::vector<at::Tensor>& out);
template <typename T>
void collect_tensors(const T& value, std::vector<at::Tensor>& out) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    out.push_back(value);
  } else if constexpr (std::is_same_v<U, std::vector<at::Tensor>>) {
    out.insert(out.end(), value.begin(), value.end());
  } else if constexpr (IsPair<U>::value) {
    collect_tensors(value.first, out);
    collect_tensors(value.second, out);
  }
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& value, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... items) { (collect_tensors(items, out), ...); }, value);
}

// The non-template engine behind FullyShardedDataParallel (src/fsdp/).
// Run when a FullyShard<Impl> has been constructed (a member initializer
// of FullyShard, so it runs after Impl's constructor): shards the unit
// under a ShardedConstruction, else does nothing.
struct ConstructionHook {
  ConstructionHook(FSDPModule& unit, torch::nn::Module& module);
};
[[noreturn]] void unwrapped_unit_called();

class FSDPCore {
 public:
  FSDPCore(torch::nn::Module& model, const FSDPOptions& options);
  ~FSDPCore();
  FSDPCore(const FSDPCore&) = delete;
  FSDPCore& operator=(const FSDPCore&) = delete;

  // `unit` is a FullyShard module of the tree, or null for the root unit.
  void before_forward(const FSDPModule* unit);
  void after_forward(const FSDPModule* unit, const std::vector<at::Tensor>& outputs);
  at::Tensor cast_input(const at::Tensor& input) const;

  std::vector<at::Tensor> shards() const;
  std::vector<std::string> unit_names() const;
  std::vector<FSDPShard> shard_layout() const;
  std::map<std::string, at::Tensor> full_state_dict(bool rank0_only);
  void load_full_state_dict(const std::map<std::string, at::Tensor>& state);
  double clip_grad_norm(double max_norm, double norm_type);
  void gather_all();
  void reshard_all(bool writeback);
  void set_sync(bool enabled);
  bool sync_enabled() const;
  FSDPStats stats() const;
  ProcessGroup& group() const;
  // HSDP: the group the shards are replicated over; null otherwise.
  ProcessGroup* replicate_group() const;
  // Pipelining: between begin_microbatches() and end_microbatches() several
  // forwards may await their backwards; each backward ends with the
  // units resharded, and reduces its gradients only when sync is on (the
  // runner turns it on before the step's last backward).
  void begin_microbatches();
  void end_microbatches();

 private:
  struct Impl;
  static void attach(FSDPModule& module, FSDPCore* core);
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail

// The FSDP side of a unit; FullyShard<Impl> derives from it and from Impl.
// A unit outside any FullyShardedDataParallel is its plain Impl (unless it
// was sharded as it was constructed: see ShardedConstruction).
class FSDPModule {
 public:
  virtual ~FSDPModule() = default;
  bool is_sharded() const { return core_ != nullptr; }

 protected:
  template <typename Body>
  decltype(auto) sharded_call(Body&& body) {
    if (core_ == nullptr) {
      if (constructed_) detail::unwrapped_unit_called();
      return body();
    }
    core_->before_forward(this);
    decltype(auto) out = body();
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(out, tensors);
    core_->after_forward(this, tensors);
    return out;
  }

 private:
  friend class detail::FSDPCore;
  friend struct detail::ConstructionHook;
  detail::FSDPCore* core_ = nullptr;  // set and cleared by the root's engine
  // Sharded at construction, until a FullyShardedDataParallel adopts it.
  std::shared_ptr<fsdp::FlatUnit> constructed_;
  std::shared_ptr<ProcessGroup> constructed_group_;
};

// While one lives on this thread (as a scope around building the model),
// every FullyShard<Impl> unit is sharded the moment it is constructed:
// rank 0's values of its parameters are broadcast, this rank keeps its
// shard and the full parameters are freed before the next unit is built.
// So building the model needs the memory of one unit (plus the parameters
// outside any unit), not of the whole model: what PyTorch gets by building
// on the meta device. Collective: every rank of the group builds the same
// model. The model must then be wrapped in a FullyShardedDataParallel over
// the same group (a unit run without it is an InvalidArgument).
//
//   std::shared_ptr<Net> net;
//   {
//     dtrain::ShardedConstruction sharded;   // the default group
//     net = std::make_shared<Net>();          // one unit in memory at a time
//   }
//   dtrain::FullyShardedDataParallel fsdp(net);
class ShardedConstruction {
 public:
  explicit ShardedConstruction(std::shared_ptr<ProcessGroup> group = nullptr);
  ~ShardedConstruction();
  ShardedConstruction(const ShardedConstruction&) = delete;
  ShardedConstruction& operator=(const ShardedConstruction&) = delete;
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  ShardedConstruction* outer_;
};

namespace detail {
template <typename Impl, typename = void>
struct ForwardSignature {
  using type = void;  // overloaded or template forward: FullyShard's forward is variadic
};
template <typename Impl>
struct ForwardSignature<Impl, std::void_t<decltype(&Impl::forward)>> {
  using type = decltype(&Impl::forward);
};
}  // namespace detail

// A unit: Impl with FSDP's gather/free around its forward. When Impl has a
// single forward, FullyShard's forward has the same signature, so it also
// works inside torch::nn::Sequential.
template <typename Impl, typename Signature = typename detail::ForwardSignature<Impl>::type>
class FullyShard : public Impl, public FSDPModule {
 public:
  using Impl::Impl;
  FullyShard() = default;
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    return sharded_call([&]() -> decltype(auto) { return Impl::forward(std::forward<Args>(args)...); });
  }

 private:
  detail::ConstructionHook construction_hook_{*this, *this};
};

template <typename Impl, typename R, typename C, typename... Args>
class FullyShard<Impl, R (C::*)(Args...)> : public Impl, public FSDPModule {
 public:
  using Impl::Impl;
  FullyShard() = default;
  R forward(Args... args) {
    return sharded_call([&]() -> R { return Impl::forward(std::forward<Args>(args)...); });
  }

 private:
  detail::ConstructionHook construction_hook_{*this, *this};
};

// Gathers every unit's full parameters into the module while it lives (a
// collective); with writeback, changes made to them go back into the
// shards when it ends (also collective: every rank must hold one).
class FullParamsGuard {
 public:
  FullParamsGuard(detail::FSDPCore& core, bool writeback) : core_(&core), writeback_(writeback) {
    core_->gather_all();
  }
  ~FullParamsGuard() noexcept(false) {
    if (core_) core_->reshard_all(writeback_);
  }
  FullParamsGuard(FullParamsGuard&& other) noexcept : core_(other.core_), writeback_(other.writeback_) {
    other.core_ = nullptr;
  }
  FullParamsGuard(const FullParamsGuard&) = delete;
  FullParamsGuard& operator=(const FullParamsGuard&) = delete;
  FullParamsGuard& operator=(FullParamsGuard&&) = delete;

 private:
  detail::FSDPCore* core_;
  bool writeback_;
};

// Restores synchronization when it goes out of scope.
using FSDPNoSyncGuard = ScopedNoSync<detail::FSDPCore>;

template <typename ModuleType>
class FullyShardedDataParallel : public torch::nn::Module {
 public:
  // Collective: broadcasts rank 0's parameters and buffers, then keeps
  // only this rank's shards.
  explicit FullyShardedDataParallel(std::shared_ptr<ModuleType> module,
                                    const FSDPOptions& options = FSDPOptions())
      : module_(register_module("module", std::move(module))),
        core_(std::make_unique<detail::FSDPCore>(*module_, options)) {}

  template <typename Impl>
  explicit FullyShardedDataParallel(torch::nn::ModuleHolder<Impl> holder,
                                    const FSDPOptions& options = FSDPOptions())
      : FullyShardedDataParallel(holder.ptr(), options) {}

  // Runs the module's forward (floating-point tensor arguments are cast to
  // the mixed-precision param_dtype); the next backward reduce-scatters the
  // gradients into the shards.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    core_->before_forward(nullptr);
    decltype(auto) out = module_->forward(cast(std::forward<Args>(args))...);
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(out, tensors);
    core_->after_forward(nullptr, tensors);
    return out;
  }

  // This rank's flat shards, one per unit: what the optimizer steps on.
  // (Hides Module::parameters(): the module's own parameters hold no
  // memory outside forward and backward.)
  std::vector<at::Tensor> parameters() const { return core_->shards(); }
  // The units' module paths ("" is the root), in the order of parameters().
  std::vector<std::string> unit_names() const { return core_->unit_names(); }
  // Where each shard lies in its unit (for distributed checkpoints).
  std::vector<FSDPShard> shard_layout() const { return core_->shard_layout(); }

  // Collective. The unsharded parameters and buffers under the module's own
  // names (as module()->named_parameters() without FSDP), copied to the
  // CPU tensors of the shards' dtype; with rank0_only the other ranks get
  // an empty map.
  std::map<std::string, at::Tensor> full_state_dict(bool rank0_only = false) {
    return core_->full_state_dict(rank0_only);
  }
  // Not collective: every rank passes the full state; it takes its shards.
  void load_full_state_dict(const std::map<std::string, at::Tensor>& state) {
    core_->load_full_state_dict(state);
  }
  // Collective: scales the shards' gradients so the norm over the whole
  // model is at most max_norm (norm_type 2 or infinity); returns the norm
  // before clipping.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0) {
    return core_->clip_grad_norm(max_norm, norm_type);
  }
  FullParamsGuard summon_full_params(bool writeback = true) { return FullParamsGuard(*core_, writeback); }
  // Under the guard, backward keeps unsharded gradients locally; the first
  // synchronized backward after it reduces them with its own.
  FSDPNoSyncGuard no_sync() { return FSDPNoSyncGuard(*core_); }

  FSDPStats stats() const { return core_->stats(); }
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  // The group the shards are split over (with HSDP, the mesh's dimension 1).
  ProcessGroup& process_group() const { return core_->group(); }
  // The engine (for dtrain's own wrappers, such as pipeline stages).
  detail::FSDPCore& engine() const { return *core_; }

 private:
  template <typename T>
  decltype(auto) cast(T&& value) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>)
      return core_->cast_input(value);
    else
      return std::forward<T>(value);
  }

  std::shared_ptr<ModuleType> module_;
  std::unique_ptr<detail::FSDPCore> core_;
};

template <typename ModuleType>
FullyShardedDataParallel(std::shared_ptr<ModuleType>) -> FullyShardedDataParallel<ModuleType>;
template <typename ModuleType>
FullyShardedDataParallel(std::shared_ptr<ModuleType>, const FSDPOptions&)
    -> FullyShardedDataParallel<ModuleType>;
template <typename Impl>
FullyShardedDataParallel(torch::nn::ModuleHolder<Impl>) -> FullyShardedDataParallel<Impl>;
template <typename Impl>
FullyShardedDataParallel(torch::nn::ModuleHolder<Impl>, const FSDPOptions&)
    -> FullyShardedDataParallel<Impl>;

}  // namespace dtrain
