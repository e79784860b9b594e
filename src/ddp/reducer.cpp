#include "ddp/reducer.h"

#include <ATen/ScalarOps.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "common/end_of_backward.h"
#include "common/enforce.h"
#include "common/error_text.h"
#include "core/control_tensors.h"
#include "core/storage_alias.h"
#include "diagnostics/timeline.h"
#include "common/logging.h"
#include "ddp/bucket_assignment.h"
#include "ddp/reducer_bucket.h"

namespace dtrain::ddp {

namespace timeline = detail::timeline;

namespace {

// Fires after AccumulateGrad has added this backward's gradient into .grad.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(Reducer* reducer, size_t index) : reducer_(reducer), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    reducer_->on_grad_ready(index_);
    return outputs;
  }

 private:
  Reducer* reducer_;
  size_t index_;
};

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

int kind_of(const at::Tensor& t) {
  return static_cast<int>(t.scalar_type()) * 4096 + static_cast<int>(t.device().type()) * 256 +
         (t.device().has_index() ? t.device().index() + 1 : 0);
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 ProcessGroup& group, ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(group),
      options_(options),
      hook_(allreduce_hook()),
      divisor_(group.size()) {
  DTRAIN_ENFORCE_EQ(params_.size(), names_.size());
  ready_.assign(params_.size(), false);
  locally_used_.assign(params_.size(), false);
  build_buckets(reverse_order(params_.size()));
  if (options_.shard_gradients) describe_shards();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    DTRAIN_ENFORCE(acc != nullptr);
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<ReadyHook>(this, i)));
    accumulators_.push_back(std::move(acc));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void Reducer::set_comm_hook(CommHook hook) {
  DTRAIN_CHECK_ARG(hook, "register_comm_hook: the hook is empty");
  std::lock_guard<std::mutex> lock(mutex_);
  DTRAIN_CHECK_ARG(!expect_backward_, "register_comm_hook: cannot change the hook between a "
                                      "forward and its backward");
  DTRAIN_CHECK_ARG(!sharded_, "register_comm_hook: DDP with shard_gradients(true) reduce-scatters "
                             "its buckets itself; a comm hook cannot replace that");
  hook_ = std::move(hook);
  custom_hook_ = true;
}

void Reducer::build_buckets(const std::vector<size_t>& order) {
  at::NoGradGuard no_grad;
  std::vector<ParamSlot> slots;
  for (const auto& p : params_)
    slots.push_back({static_cast<size_t>(p.numel() * p.element_size()), kind_of(p)});
  auto assignment = assign_buckets(slots, order, options_.first_bucket_bytes, options_.bucket_bytes);
  buckets_.clear();
  slot_of_.assign(params_.size(), Slot{0, 0});
  for (size_t b = 0; b < assignment.size(); ++b) {
    auto bucket = std::make_unique<Bucket>();
    bucket->members = assignment[b];
    for (size_t i : bucket->members) bucket->numel += params_[i].numel();
    bucket->bytes = bucket->numel * params_[bucket->members.front()].element_size();
    bucket->grad.index = static_cast<int>(b);
    for (size_t pos = 0; pos < bucket->members.size(); ++pos) {
      bucket->grad.parameter_names.push_back(names_[bucket->members[pos]]);
      slot_of_[bucket->members[pos]] = Slot{b, pos};
    }
    // Sharded buckets get their memory when their first gradient arrives
    // and give it back once reduce-scattered (materialize, release_*).
    if (!options_.shard_gradients) {
      const auto& first = params_[bucket->members.front()];
      bucket->grad.buffer = at::zeros({bucket->numel}, first.options().requires_grad(false));
      make_views(*bucket);
    }
    bucket->pending = bucket->members.size();
    buckets_.push_back(std::move(bucket));
  }
  stats_.bucket_bytes.clear();
  for (const auto& b : buckets_) stats_.bucket_bytes.push_back(b->bytes);
}

// One view of the bucket's buffer per member, in slot order.
void Reducer::make_views(Bucket& bucket) {
  bucket.grad.gradients.clear();
  int64_t offset = 0;
  for (size_t i : bucket.members) {
    // Not an autograd view, so that zero_grad works with gradient_as_bucket_view.
    auto view = detail::storage_alias(bucket.grad.buffer, offset, params_[i].sizes());
    offset += params_[i].numel();
    bucket.grad.gradients.push_back(view);
    if (options_.gradient_as_bucket_view) {
      auto& grad = params_[i].mutable_grad();
      if (grad.defined()) view.copy_(grad);
      grad = view;
    }
  }
}

void Reducer::prepare_for_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (backward_started_) abandon_unfinished_backward();
  DTRAIN_CHECK_ARG(!sharded_ || sharded_->attached,
                   "DistributedDataParallel(shard_gradients=true): no ZeroRedundancyOptimizer is "
                   "built over this DDP. Its averaged gradients exist only as each rank's share, "
                   "which only ZeroRedundancyOptimizer(ddp, factory) steps on; build one before "
                   "the first forward (ZeroRedundancyOptimizer(ddp.parameters(), ...) and other "
                   "optimizers read .grad, which stays empty)");
  expect_backward_ = true;
  if (options_.static_graph && iteration_ > 0) {
    // Known to stay unused: they must not hold back their buckets.
    for (size_t i = 0; i < params_.size(); ++i)
      if (static_unused_[i] && !ready_[i]) mark_ready(i, /*has_grad=*/false);
  }
}

void Reducer::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!expect_backward_) return;  // no_sync, or a backward not after a DDP forward
  if (!backward_started_) {
    backward_started_ = true;
    backward_start_ = Clock::now();
    // At the end of the whole backward, also when a checkpointed segment's
    // recomputation runs a backward inside it (activation_checkpoint.h).
    detail::queue_end_of_backward([this] { finalize(false); });
  }
  if (ready_[index]) {
    if (options_.static_graph && iteration_ > 0 && static_unused_[index])
      throw InvalidArgument(detail::cat(
          "DistributedDataParallel(static_graph=true): parameter '", names_[index],
          "' received a gradient in iteration ", iteration_,
          " but none in the first iteration; the set of used parameters must not change"));
    throw InvalidArgument(detail::cat("DistributedDataParallel: parameter '", names_[index],
                                      "' received its gradient twice in one backward; run one "
                                      "backward per forward (reentrant backward is not supported)"));
  }
  mark_ready(index, /*has_grad=*/true);
}

void Reducer::mark_ready(size_t index, bool has_grad) {
  at::NoGradGuard no_grad;
  ready_[index] = true;
  locally_used_[index] = has_grad;
  if (!rebuilt_ && iteration_ == 0 && has_grad) observed_order_.push_back(index);
  // One rank and the default hook: the gradient is already the average.
  // Nothing is copied into a bucket, launched or written back, so DDP at
  // world size 1 costs what the plain model does.
  if (solo()) return;
  auto& bucket = *buckets_[slot_of_[index].bucket];
  if (sharded_ && !bucket.grad.buffer.defined()) materialize(bucket);
  auto& view = bucket.grad.gradients[slot_of_[index].position];
  auto& grad = params_[index].mutable_grad();
  // The default hook averages: the division rides on the copy into the
  // bucket (one pass over the gradient instead of two). A custom hook gets
  // the sums and the divisor.
  const bool divide = !custom_hook_ && divisor_ != 1.0;
  auto fill_from = [&](const at::Tensor& g) {
    if (divide) {
      auto d = c10::scalar_to_tensor(divisor_);
      d.unsafeGetTensorImpl()->set_wrapped_number(true);  // keeps the gradient's dtype
      at::div_out(view, g, d);
    } else {
      view.copy_(g);
    }
  };
  if (!has_grad || !grad.defined()) {
    view.zero_();
  } else if (!options_.gradient_as_bucket_view) {
    fill_from(grad);
  } else if (!grad.is_alias_of(view)) {
    // zero_grad(set_to_none) or a user assignment replaced the view.
    fill_from(grad);
    grad = view;
  } else if (divide) {
    view.div_(divisor_);
  }
  if (sharded_) grad = at::Tensor();  // in the bucket now; the full gradient is not kept
  DTRAIN_ENFORCE(bucket.pending > 0);
  if (--bucket.pending == 0) {
    bucket.ready = true;
    bucket.readied = Clock::now();
    launch_ready_buckets();
  }
}

void Reducer::launch_ready_buckets() {
  // Launch strictly in bucket order so every rank issues the same sequence.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_]->ready) {
    Bucket* b = buckets_[next_launch_].get();
    b->grad.iteration = iteration_;
    b->grad.divisor = divisor_;
    b->grad.is_last = next_launch_ + 1 == buckets_.size();
    b->launched = Clock::now();
    if (sharded_) {
      launch_sharded(next_launch_++);
      continue;
    }
    if (!custom_hook_) {
      // The default hook is asynchronous by nature: issue it right here and
      // save the hand-off to the communication thread. The gradients were
      // divided on their way into the bucket (mark_ready).
      b->work = group_.all_reduce(b->grad.buffer, ReduceOp::SUM);
      b->work->on_success([b] { b->done = Clock::now(); });
      ++next_launch_;
      continue;
    }
    b->work = std::make_shared<Work>(detail::cat("DDP bucket #", next_launch_, " of iteration ",
                                                 iteration_));
    comm_.submit([this, b, work = b->work] {
      std::exception_ptr error;
      try {
        hook_(group_, b->grad);
      } catch (...) {
        error = std::current_exception();
      }
      b->done = Clock::now();
      work->finish(error);
    });
    ++next_launch_;
  }
}

void Reducer::wait_for_buckets() {
  std::exception_ptr first_error;
  for (auto& b : buckets_) {
    if (!b->work) continue;
    try {
      b->work->wait();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

std::vector<bool> Reducer::globally_used() {
  auto map = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
  auto* m = map.data_ptr<int32_t>();
  for (size_t i = 0; i < params_.size(); ++i) m[i] = locally_used_[i] ? 1 : 0;
  map = detail::all_reduce_control(group_, map, ReduceOp::MAX);
  m = map.data_ptr<int32_t>();
  std::vector<bool> used(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) used[i] = m[i] != 0;
  return used;
}

void Reducer::write_back(const std::vector<bool>& used) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!used[i]) continue;  // no rank used it: leave .grad as it was, like PyTorch
    const auto& view = buckets_[slot_of_[i].bucket]->grad.gradients[slot_of_[i].position];
    auto& grad = params_[i].mutable_grad();
    if (options_.gradient_as_bucket_view) {
      if (!grad.defined() || !grad.is_alias_of(view)) grad = view;
    } else if (!grad.defined()) {
      grad = view.clone();
    } else {
      grad.copy_(view);
    }
  }
}

void Reducer::rebuild_from_observed_order() {
  // Parameters that never got a gradient go last, in reverse registration order.
  std::vector<bool> seen(params_.size(), false);
  std::vector<int64_t> order;
  for (size_t i : observed_order_)
    if (!seen[i]) {
      seen[i] = true;
      order.push_back(static_cast<int64_t>(i));
    }
  for (size_t i : reverse_order(params_.size()))
    if (!seen[i]) order.push_back(static_cast<int64_t>(i));
  // Every rank must bucket identically: take rank 0's order.
  auto t = detail::broadcast_control(group_, at::tensor(order, at::kLong), 0);
  std::vector<size_t> agreed(params_.size());
  for (size_t k = 0; k < agreed.size(); ++k) agreed[k] = static_cast<size_t>(t[k].item<int64_t>());
  build_buckets(agreed);
  rebuilt_ = true;
  stats_.buckets_rebuilt = true;
}

void Reducer::reset_iteration() {
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(locally_used_.begin(), locally_used_.end(), false);
  if (sharded_) release_sharded_buffers();
  for (auto& b : buckets_) {
    b->pending = b->members.size();
    b->ready = false;
    b->work.reset();
  }
  next_launch_ = 0;
  expect_backward_ = false;
  backward_started_ = false;
}

// The previous backward ended in an exception (a NaN check, an out-of-memory
// that the loop caught and skipped): the autograd engine does not run
// finalize() then, so its buckets are still pending. Let the ones launched
// finish — every rank that hit the same exception launched the same ones, in
// the same order — and start afresh; the gradients of that step are dropped.
// A rank whose peers did not launch the same buckets waits here until the
// group's timeout and reports it; the peers fail the same way in theirs.
void Reducer::abandon_unfinished_backward() {
  const size_t launched = next_launch_;
  std::exception_ptr error;
  try {
    wait_for_buckets();
  } catch (...) {
    error = std::current_exception();
  }
  if (!rebuilt_ && iteration_ == 0) observed_order_.clear();
  reset_iteration();
  if (!error) return;
  const std::string why = detail::error_text(error);
  throw NetworkError(detail::cat(
      "DistributedDataParallel: the previous backward ended in an exception after launching ",
      launched, " of ", buckets_.size(), " gradient buckets, and they did not complete (", why,
      "). The ranks disagree: an exception in forward or backward must happen on every rank "
      "alike for training to go on."));
}

void Reducer::fail_missing_gradients(const std::vector<size_t>& missing) {
  // Let what is in flight finish so the group stays consistent, then report.
  try {
    wait_for_buckets();
  } catch (...) {
  }
  reset_iteration();
  std::vector<std::string> names;
  for (size_t i : missing) names.push_back("'" + names_[i] + "'");
  throw InvalidArgument(detail::cat(
      "DistributedDataParallel: ", missing.size(), " parameter(s) received no gradient in this "
      "backward: ", detail::join(names), ". Every parameter must take part in computing the loss. "
      "If some legitimately do not (branches taken per input, frozen parts), construct DDP with "
      "DDPOptions().find_unused_parameters(true)."));
}

// DTRAIN_TIMELINE: backward and the wait for the buckets on the step
// track, each bucket's launch to done on its own track (the sum of these is
// DDPStats::communication_ms).
void Reducer::draw_timeline(Clock::time_point backward_end, Clock::time_point wait_start,
                            Clock::time_point wait_end) {
  if (backward_started_) {
    timeline::name_track(timeline::kStepTrack, "step");
    timeline::span("backward", timeline::kStepTrack, backward_start_, backward_end,
                   detail::cat("\"iteration\": ", iteration_));
    timeline::span("wait for buckets", timeline::kStepTrack, wait_start, wait_end);
  }
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const auto& b = *buckets_[k];
    if (!b.work) continue;
    timeline::name_track(timeline::kBucketTrack + static_cast<int>(k),
                         detail::cat("DDP bucket ", k));
    // Ready, but an earlier bucket was not yet: launches keep bucket order.
    if (b.launched > b.readied + std::chrono::microseconds(1))
      timeline::span(detail::cat("bucket ", k, " ready"), timeline::kBucketTrack + static_cast<int>(k),
                     b.readied, b.launched, detail::cat("\"iteration\": ", iteration_));
    timeline::span(detail::cat("bucket ", k), timeline::kBucketTrack + static_cast<int>(k),
                   b.launched, b.done,
                   detail::cat("\"iteration\": ", iteration_, ", \"bytes\": ",
                               b.bytes));
  }
  timeline::flush();
}

void Reducer::finalize(bool shadow) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto backward_end = Clock::now();
  const bool learning_unused = options_.static_graph && iteration_ == 0;
  const bool tolerate_unused = options_.find_unused_parameters || learning_unused;
  std::vector<size_t> missing;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!ready_[i]) missing.push_back(i);
  if (!missing.empty()) {
    if (!tolerate_unused && !shadow) fail_missing_gradients(missing);
    for (size_t i : missing) mark_ready(i, /*has_grad=*/false);
  }
  const auto wait_start = Clock::now();
  try {
    wait_for_buckets();
  } catch (...) {
    reset_iteration();
    throw;
  }
  const auto wait_end = Clock::now();
  auto used = tolerate_unused && !solo() ? globally_used() : std::vector<bool>(params_.size(), true);
  if (sharded_) {
    settle_sharded();
  } else if (!shadow && !solo()) {
    write_back(used);
  }
  if (learning_unused) {
    static_unused_.assign(params_.size(), false);
    for (size_t i = 0; i < params_.size(); ++i) static_unused_[i] = !locally_used_[i];
  }

  stats_.iteration = iteration_ + 1;
  stats_.backward_ms = backward_started_ ? ms(backward_end - backward_start_) : 0;
  stats_.communication_ms = 0;
  for (const auto& b : buckets_)
    if (b->work) stats_.communication_ms += ms(b->done - b->launched);
  stats_.exposed_ms = ms(wait_end - wait_start);
  stats_.hidden_fraction =
      stats_.communication_ms > 0
          ? std::clamp(1.0 - stats_.exposed_ms / stats_.communication_ms, 0.0, 1.0)
          : 0.0;
  if (timeline::enabled()) draw_timeline(backward_end, wait_start, wait_end);  // before a rebuild
  stats_.buckets_rebuilt = false;
  // Sharded buckets keep their layout: the optimizer's partition follows it.
  if (!rebuilt_ && iteration_ == 0 && !sharded_ &&
      (!options_.find_unused_parameters || options_.static_graph))
    rebuild_from_observed_order();
  DTRAIN_LOG_INFO("ddp: iteration ", stats_.iteration, ": backward ", stats_.backward_ms,
                  " ms, communication ", stats_.communication_ms, " ms (",
                  static_cast<int>(stats_.hidden_fraction * 100), "% hidden behind backward), ",
                  buckets_.size(), " buckets of ", detail::join(stats_.bucket_bytes), " bytes",
                  stats_.buckets_rebuilt ? " (rebuilt from the observed gradient order)" : "");
  reset_iteration();
  ++iteration_;
}

void Reducer::shadow_backward() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    expect_backward_ = true;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!ready_[i]) mark_ready(i, /*has_grad=*/false);
  }
  finalize(/*shadow=*/true);
}

DDPStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace dtrain::ddp
