// DDPCore: what DistributedDataParallel does around the reducer —
// construction checks, keeping replicas in sync, no_sync and join.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <set>

#include "common/cpu_memory.h"
#include "common/enforce.h"
#include "core/control_tensors.h"
#include "diagnostics/timeline.h"
#include "common/logging.h"
#include "ddp/model_sync.h"
#include "ddp/reducer.h"
#include "dtrain/ddp.h"
#include "dtrain/distributed.h"

namespace dtrain::detail {

struct DDPCore::Impl {
  std::shared_ptr<ProcessGroup> group;
  std::chrono::steady_clock::time_point forward_start;  // DTRAIN_TIMELINE
  DDPOptions options;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;
  std::unique_ptr<ddp::Reducer> reducer;
  bool sync = true;
  // join
  bool joining = false;
  JoinOptions join_options;
  int64_t trained_iterations = 0;

  // One all_reduce per forward while joining: {ranks still training,
  // ranks that will synchronize gradients in this iteration}.
  std::pair<int64_t, int64_t> join_round(bool training, bool will_sync) {
    auto t = at::zeros({2}, at::kLong);
    t[0] = training ? 1 : 0;
    t[1] = will_sync ? 1 : 0;
    t = all_reduce_control(*group, t, ReduceOp::SUM);
    return {t[0].item<int64_t>(), t[1].item<int64_t>()};
  }

  void check_early_termination(int64_t active) {
    if (join_options.throw_on_early_termination() && active < group->size())
      throw InvalidArgument(cat("DistributedDataParallel::join: ", group->size() - active,
                                " rank(s) ran out of data while others still train "
                                "(throw_on_early_termination is set); rank ", group->rank(),
                                " stops here"));
  }

  void set_divisor(int64_t active) {
    reducer->set_divisor(join_options.divide_by_initial_world_size()
                             ? static_cast<double>(group->size())
                             : static_cast<double>(std::max<int64_t>(active, 1)));
  }

  void sync_buffers() {
    if (options.broadcast_buffers() && !buffers.empty()) ddp::broadcast_coalesced(*group, buffers, 0);
  }
};

DDPCore::DDPCore(torch::nn::Module& wrapper, const DDPOptions& options)
    : impl_(std::make_unique<Impl>()) {
  apply_cpu_memory_policy();
  auto& s = *impl_;
  s.options = options;
  s.group = options.process_group() ? options.process_group() : default_group();
  DTRAIN_CHECK_ARG(s.group->rank() >= 0,
                   "DistributedDataParallel: this rank is not a member of group '",
                   s.group->name(), "'");
  DTRAIN_CHECK_ARG(options.bucket_cap_mb() > 0, "DDPOptions::bucket_cap_mb must be positive, got ",
                   options.bucket_cap_mb());
  DTRAIN_CHECK_ARG(!(options.shard_gradients() && options.gradient_as_bucket_view()),
                   "DistributedDataParallel: shard_gradients and gradient_as_bucket_view exclude "
                   "each other (under shard_gradients a rank keeps no full gradient)");
  std::set<std::string> ignored(options.params_and_buffers_to_ignore().begin(),
                                options.params_and_buffers_to_ignore().end());
  const size_t to_ignore = ignored.size();
  // (Names relative to the wrapped module, which the wrapper holds as "module".)
  auto skip = [&](const std::string& name) {
    return name.rfind("module.", 0) == 0 && ignored.erase(name.substr(7)) > 0;
  };
  std::vector<std::string> names;
  for (const auto& item : wrapper.named_parameters(/*recurse=*/true)) {
    if (skip(item.key())) continue;
    if (!item.value().requires_grad()) continue;  // frozen: not synchronized, as in PyTorch
    names.push_back(item.key());
    s.params.push_back(item.value());
  }
  DTRAIN_CHECK_ARG(!s.params.empty(),
                   "DistributedDataParallel: the module has no parameter that requires grad");
  for (const auto& p : s.params)
    DTRAIN_CHECK_ARG(s.group->supports(p.device().type()), "DistributedDataParallel: parameter on ",
                     p.device(), " but backend '", s.group->backend_name(),
                     "' does not handle that device");
  std::vector<std::string> buffer_names;
  for (const auto& item : wrapper.named_buffers(/*recurse=*/true)) {
    if (skip(item.key())) continue;
    buffer_names.push_back(item.key());
    s.buffers.push_back(item.value());
  }
  DTRAIN_CHECK_ARG(ignored.empty(), "DistributedDataParallel: params_and_buffers_to_ignore names ",
                   ignored.size(), " of its ", to_ignore, " entries that the module does not have: ",
                   detail::join(std::vector<std::string>(ignored.begin(), ignored.end())));

  ddp::verify_same_model(*s.group, names, s.params);
  // Every replica starts from rank 0's state.
  ddp::broadcast_coalesced(*s.group, s.params, 0);
  ddp::broadcast_coalesced(*s.group, s.buffers, 0);

  ddp::ReducerOptions ro;
  ro.bucket_bytes = static_cast<size_t>(options.bucket_cap_mb() * 1024 * 1024);
  ro.first_bucket_bytes = std::min<size_t>(1 << 20, ro.bucket_bytes);
  ro.gradient_as_bucket_view = options.gradient_as_bucket_view();
  ro.find_unused_parameters = options.find_unused_parameters();
  ro.static_graph = options.static_graph();
  ro.shard_gradients = options.shard_gradients();
  s.reducer = std::make_unique<ddp::Reducer>(s.params, names, *s.group, ro);
  DTRAIN_LOG_INFO("ddp: wrapping ", s.params.size(), " parameters and ", s.buffers.size(),
                  " buffers on group '", s.group->name(), "' (", s.group->size(), " ranks)");
}

DDPCore::~DDPCore() = default;

void DDPCore::pre_forward() {
  auto& s = *impl_;
  if (detail::timeline::enabled()) s.forward_start = std::chrono::steady_clock::now();
  if (s.joining) {
    auto [active, syncing] = s.join_round(true, s.sync && at::GradMode::is_enabled());
    (void)syncing;
    s.check_early_termination(active);
    s.set_divisor(active);
    ++s.trained_iterations;
  }
  s.sync_buffers();
}

void DDPCore::post_forward() {
  auto& s = *impl_;
  if (detail::timeline::enabled()) {
    detail::timeline::name_track(detail::timeline::kStepTrack, "step");
    detail::timeline::span("forward", detail::timeline::kStepTrack, s.forward_start,
                           std::chrono::steady_clock::now());
  }
  if (s.sync && at::GradMode::is_enabled()) s.reducer->prepare_for_backward();
}

void DDPCore::set_sync(bool enabled) { impl_->sync = enabled; }
bool DDPCore::sync_enabled() const { return impl_->sync; }
void DDPCore::sync_next_backward() {
  impl_->sync = true;
  if (at::GradMode::is_enabled()) impl_->reducer->prepare_for_backward();
}
void DDPCore::register_comm_hook(CommHook hook) { impl_->reducer->set_comm_hook(std::move(hook)); }
DDPStats DDPCore::stats() const { return impl_->reducer->stats(); }
ProcessGroup& DDPCore::group() const { return *impl_->group; }
std::shared_ptr<ProcessGroup> DDPCore::shared_group() const { return impl_->group; }
const std::vector<torch::Tensor>& DDPCore::parameters() const { return impl_->params; }
std::shared_ptr<ddp::ShardedGradients> DDPCore::sharded_gradients() const {
  return impl_->reducer->sharded_gradients();
}

void DDPCore::join(const JoinOptions& options, const std::function<void()>& body) {
  auto& s = *impl_;
  DTRAIN_CHECK_ARG(!s.joining, "DistributedDataParallel::join cannot be nested");
  DTRAIN_CHECK_ARG(!s.options.shard_gradients(),
                   "DistributedDataParallel::join: not available with shard_gradients(true) (the "
                   "ZeroRedundancyOptimizer's step is collective and a joined rank does not step)");
  s.joining = true;
  s.join_options = options;
  s.trained_iterations = 0;
  struct Reset {
    Impl& s;
    ~Reset() {
      s.joining = false;
      s.reducer->set_divisor(s.group->size());
    }
  } reset{s};
  body();
  // Out of data: mirror the collectives of the ranks still training.
  for (;;) {
    auto [active, syncing] = s.join_round(false, false);
    if (active == 0) break;
    s.check_early_termination(active);
    s.set_divisor(active);
    s.sync_buffers();
    if (syncing > 0) s.reducer->shadow_backward();
  }
  // Everyone ends with the model of the rank that trained longest (ties:
  // the highest rank), as PyTorch's DDP join does.
  auto key = at::full({1}, s.trained_iterations * s.group->size() + s.group->rank(), at::kLong);
  key = all_reduce_control(*s.group, key, ReduceOp::MAX);
  const int authority = static_cast<int>(key.item<int64_t>() % s.group->size());
  ddp::broadcast_coalesced(*s.group, s.params, authority);
  ddp::broadcast_coalesced(*s.group, s.buffers, authority);
}

}  // namespace dtrain::detail
