#include "fsdp/flat_unit.h"

#include <ATen/core/grad_mode.h>  // at::NoGradGuard (its own header on libtorch 2.x)
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "common/enforce.h"
#include "fsdp/mapped_memory.h"

namespace dtrain::fsdp {
namespace {

// Fires after AccumulateGrad has written this backward's gradient.
class GradHook : public torch::autograd::FunctionPostHook {
 public:
  GradHook(std::function<void()> fire) : fire_(std::move(fire)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fire_();
    return outputs;
  }

 private:
  std::function<void()> fire_;
};

void check_unit(const std::string& unit, const std::vector<at::Tensor>& params,
                const std::vector<std::string>& names) {
  const auto& first = params.front();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const char* what = p.scalar_type() != first.scalar_type() || p.device() != first.device()
                           ? "dtype and device"
                           : p.requires_grad() != first.requires_grad() ? "requires_grad"
                                                                        : nullptr;
    DTRAIN_CHECK_ARG(what == nullptr, "FullyShardedDataParallel: in unit '", unit, "', parameter '",
                     names[i], "' (", p.scalar_type(), " on ", p.device(), ", requires_grad ",
                     p.requires_grad(), ") and parameter '", names[0], "' (", first.scalar_type(),
                     " on ", first.device(), ", requires_grad ", first.requires_grad(),
                     ") differ in ", what, "; a unit's parameters are one flat buffer: make them "
                     "alike or put them in different units");
    DTRAIN_CHECK_ARG(p.numel() == 0 || p.storage().nbytes() > 0, "FullyShardedDataParallel: parameter '",
                     names[i], "' holds no memory: was its module already wrapped by a "
                     "FullyShardedDataParallel? (once wrapped, a module's parameters live in the "
                     "shards; load its full_state_dict() into a fresh module instead)");
    DTRAIN_CHECK_ARG(at::isFloatingType(p.scalar_type()), "FullyShardedDataParallel: parameter '",
                     names[i], "' is ", p.scalar_type(), "; only floating-point parameters can be sharded");
  }
}

}  // namespace

FlatUnit::FlatUnit(std::string name, std::vector<at::Tensor> params, std::vector<std::string> names,
                   ProcessGroup& group)
    : name_(std::move(name)), params_(std::move(params)), names_(std::move(names)), group_(group) {
  DTRAIN_ENFORCE(!params_.empty());
  check_unit(name_, params_, names_);
  at::NoGradGuard no_grad;
  const auto& first = params_.front();
  trainable_ = first.requires_grad();
  for (const auto& p : params_) {
    offsets_.push_back(numel_);
    numel_ += p.numel();
  }
  const int world = group_.size();
  slice_ = (numel_ + world - 1) / world;
  // Rank 0's values, flat and padded, are every rank's starting point.
  auto flat = at::zeros({slice_ * world}, first.options().requires_grad(false));
  for (size_t i = 0; i < params_.size(); ++i)
    flat.narrow(0, offsets_[i], params_[i].numel()).copy_(params_[i].detach().reshape({-1}));
  if (world > 1) group_.broadcast(flat, 0)->wait();
  shard_ = flat.narrow(0, group_.rank() * slice_, slice_).clone().requires_grad_(trainable_);
  flat = at::Tensor();
  compute_dtype_ = reduce_dtype_ = first.scalar_type();
  make_views(compute_dtype_);
}

// The parameters become views of an unallocated full buffer of `dtype`
// (their own memory is released here).
void FlatUnit::make_views(at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  full_ = at::empty({slice_ * group_.size()}, shard_.options().dtype(dtype).requires_grad(false));
  full_bytes_ = full_.nbytes();
  allocated_ = true;
  for (size_t i = 0; i < params_.size(); ++i)
    params_[i].set_data(full_.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes()));
  free_storage();
}

void FlatUnit::configure(const MixedPrecision& precision,
                         std::function<void(FlatUnit&, size_t)> on_grad) {
  DTRAIN_ENFORCE(accumulators_.empty());
  const auto param_dtype = shard_.scalar_type();
  compute_dtype_ = precision.param_dtype().value_or(param_dtype);
  reduce_dtype_ = precision.reduce_dtype().value_or(compute_dtype_);
  if (compute_dtype_ != full_.scalar_type()) make_views(compute_dtype_);
  if (!trainable_) return;
  has_grad_.assign(params_.size(), false);
  trainable_count_ = params_.size();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    DTRAIN_ENFORCE(acc != nullptr);
    hook_keys_.push_back(acc->add_post_hook(
        std::make_unique<GradHook>([this, i, on_grad] { on_grad(*this, i); })));
    accumulators_.push_back(std::move(acc));
  }
}

void FlatUnit::rename(std::string name, std::vector<std::string> names) {
  DTRAIN_ENFORCE_EQ(names.size(), names_.size());
  name_ = std::move(name);
  names_ = std::move(names);
}

FlatUnit::~FlatUnit() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void FlatUnit::free_storage() {
  auto storage = full_.storage();
  storage.set_data_ptr_noswap(at::DataPtr(nullptr, full_.device()));
  storage.set_nbytes(0);
  allocated_ = false;
}

void FlatUnit::start_gather() {
  if (allocated_) return;
  auto storage = full_.storage();
  storage.set_data_ptr_noswap(allocate_transient(full_bytes_, storage, full_.device()));
  storage.set_nbytes(full_bytes_);
  allocated_ = true;
  at::NoGradGuard no_grad;
  gather_input_ = shard_.detach();
  if (gather_input_.scalar_type() != compute_dtype_) gather_input_ = gather_input_.to(compute_dtype_);
  gather_work_ = group_.all_gather_into_tensor(full_, gather_input_);
}

void FlatUnit::wait_gathered() {
  start_gather();
  if (gather_work_) {
    auto work = std::move(gather_work_);
    gather_work_ = nullptr;
    work->wait();
    gather_input_ = at::Tensor();
  }
}

void FlatUnit::reshard(bool writeback) {
  if (!allocated_) return;
  wait_gathered();
  if (writeback) {
    at::NoGradGuard no_grad;
    shard_.detach().copy_(full_.narrow(0, group_.rank() * slice_, slice_));
  }
  free_storage();
}

bool FlatUnit::count_grad(size_t index) {
  if (!has_grad_[index]) {
    has_grad_[index] = true;
    ++grads_;
  }
  return grads_ == trainable_count_;
}

void FlatUnit::reduce(bool sync) {
  DTRAIN_ENFORCE(trainable_ && !reduced_);
  at::NoGradGuard no_grad;
  reduced_ = true;
  const int world = group_.size();
  auto flat = transient_zeros(slice_ * world, full_.options().dtype(reduce_dtype_));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& grad = params_[i].mutable_grad();
    if (!grad.defined()) continue;
    flat.narrow(0, offsets_[i], params_[i].numel()).copy_(grad.reshape({-1}));
    grad = at::Tensor();
  }
  if (!sync) {
    if (unsynced_.defined())
      unsynced_.add_(flat);
    else
      unsynced_ = std::move(flat);
    return;
  }
  if (unsynced_.defined()) {
    flat.add_(unsynced_);
    unsynced_ = at::Tensor();
  }
  // Divided before the sum, as DDP's buckets are: the same rounding.
  const int ways = world * (replicas_ ? replicas_->size() : 1);
  if (ways > 1) flat.div_(ways);
  reduce_input_ = std::move(flat);
  reduce_output_ = at::empty({slice_}, reduce_input_.options());
  reduce_work_ = group_.reduce_scatter_tensor(reduce_output_, reduce_input_, ReduceOp::SUM);
}

void FlatUnit::replicate_over(ProcessGroup& replicas) {
  replicas_ = &replicas;
  if (replicas.size() <= 1) return;
  auto values = shard_.detach();
  replicas.broadcast(values, 0)->wait();
}

void FlatUnit::replicate_with(std::function<WorkPtr(at::Tensor)> average) { replica_average_ = std::move(average); }

void FlatUnit::start_replica_reduce() {
  if (replica_work_) return;
  if (replicas_ && replicas_->size() > 1) {
    reduce_input_ = at::Tensor();  // the reduce-scatter is done with it
    replica_work_ = replicas_->all_reduce(reduce_output_, ReduceOp::SUM);
  } else if (replica_average_) {
    reduce_input_ = at::Tensor();
    replica_work_ = replica_average_(reduce_output_);
  }
}

bool FlatUnit::reduce_complete() {
  if (!reduce_work_) return true;
  if (!reduce_work_->is_completed()) return false;
  start_replica_reduce();
  return !replica_work_ || replica_work_->is_completed();
}

void FlatUnit::finish_reduce() {
  if (!reduce_work_) return;
  auto work = std::move(reduce_work_);
  reduce_work_ = nullptr;
  work->wait();
  start_replica_reduce();  // unless reduce_complete() started it
  auto replica = std::move(replica_work_);
  replica_work_ = nullptr;
  if (replica) replica->wait();
  at::NoGradGuard no_grad;
  auto average = reduce_output_.to(shard_.scalar_type());
  reduce_input_ = reduce_output_ = at::Tensor();
  auto& grad = shard_.mutable_grad();
  if (grad.defined())
    grad.add_(average);
  else
    grad = average;
}

int64_t FlatUnit::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto* t : {&reduce_input_, &reduce_output_, &unsynced_})
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  return bytes;
}

void FlatUnit::reset_iteration() {
  std::fill(has_grad_.begin(), has_grad_.end(), false);
  grads_ = 0;
  reduced_ = false;
}

std::vector<at::Tensor> FlatUnit::gather_master() {
  at::NoGradGuard no_grad;
  auto flat = at::empty({slice_ * group_.size()}, shard_.options().requires_grad(false));
  group_.all_gather_into_tensor(flat, shard_.detach())->wait();
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < params_.size(); ++i)
    out.push_back(flat.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes()));
  return out;
}

void FlatUnit::load_full(const std::vector<at::Tensor>& values) {
  DTRAIN_ENFORCE_EQ(values.size(), params_.size());
  at::NoGradGuard no_grad;
  const int64_t begin = group_.rank() * slice_;
  auto shard = shard_.detach();
  shard.zero_();
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t lo = std::max(offsets_[i], begin);
    const int64_t hi = std::min(offsets_[i] + params_[i].numel(), begin + slice_);
    if (lo >= hi) continue;
    shard.narrow(0, lo - begin, hi - lo)
        .copy_(values[i].reshape({-1}).narrow(0, lo - offsets_[i], hi - lo));
  }
}

}  // namespace dtrain::fsdp
