#include "dtrain/optim/zero_redundancy_optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (its own header on libtorch 2.x)

#include <algorithm>

#include "checkpoint/optimizer_state.h"
#include "common/enforce.h"
#include "dtrain/distributed.h"

namespace dtrain {
namespace {

const char* const kWho = "ZeroRedundancyOptimizer";

int64_t total_numel(const std::vector<torch::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

// ceil(total / world): every slice has this length; the last rank's may
// reach past the end (padding nobody reads).
int64_t slice_length(int64_t total, int world) { return (total + world - 1) / world; }

void check_params(const std::vector<torch::Tensor>& params) {
  DTRAIN_CHECK_ARG(!params.empty(), kWho, ": no parameters to optimize");
  const auto& first = params.front();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    DTRAIN_CHECK_ARG(p.defined(), kWho, ": parameter ", i, " is undefined");
    DTRAIN_CHECK_ARG(p.scalar_type() == first.scalar_type() && p.device() == first.device(), kWho,
                     ": parameter ", i, " is ", p.scalar_type(), " on ", p.device(),
                     " but parameter 0 is ", first.scalar_type(), " on ", first.device(),
                     " (all parameters must share a dtype and a device)");
    DTRAIN_CHECK_ARG(p.is_contiguous(), kWho, ": parameter ", i, " is not contiguous");
  }
}

}  // namespace

ZeroRedundancyOptimizer::Parts ZeroRedundancyOptimizer::prepare(
    const std::vector<torch::Tensor>& params, const Factory& make_local,
    const ZeroRedundancyOptions& options) {
  check_params(params);
  DTRAIN_CHECK_ARG(static_cast<bool>(make_local), kWho, ": the local optimizer factory is empty");
  Parts parts;
  parts.group = options.process_group() ? options.process_group() : default_group();
  DTRAIN_CHECK_ARG(parts.group && parts.group->rank() >= 0, kWho,
                   ": this rank is not a member of the group");
  const int64_t slice = slice_length(total_numel(params), parts.group->size());
  // The parameters' values, flat and padded; this rank's slice of it is
  // the tensor the local optimizer steps on (no copy of its own).
  at::NoGradGuard no_grad;
  parts.flat = at::zeros({slice * parts.group->size()}, params.front().options().requires_grad(false));
  int64_t offset = 0;
  for (const auto& p : params) {
    parts.flat.narrow(0, offset, p.numel()).copy_(p.detach().reshape({-1}));
    offset += p.numel();
  }
  parts.shard = parts.flat.narrow(0, slice * parts.group->rank(), slice);
  parts.local = make_local({parts.shard});
  DTRAIN_CHECK_ARG(parts.local != nullptr, kWho, ": the factory returned no optimizer");
  DTRAIN_CHECK_ARG(parts.local->param_groups().size() == 1 &&
                       parts.local->param_groups()[0].params().size() == 1 &&
                       parts.local->param_groups()[0].params()[0].is_same(parts.shard),
                   kWho, ": the factory must build its optimizer over the one tensor it is given");
  return parts;
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                                                 const Factory& make_local,
                                                 ZeroRedundancyOptions options)
    : ZeroRedundancyOptimizer(params, prepare(params, make_local, options)) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, Parts parts)
    : torch::optim::Optimizer(params, parts.local->param_groups()[0].options().clone()),
      group_(std::move(parts.group)),
      shard_(std::move(parts.shard)),
      flat_(std::move(parts.flat)),
      local_(std::move(parts.local)) {
  const auto& all = param_groups()[0].params();
  total_ = total_numel(all);
  slice_ = shard_.numel();
  begin_ = std::min<int64_t>(total_, slice_ * group_->rank());
  end_ = std::min<int64_t>(total_, begin_ + slice_);
  // The pieces of the parameters that fall inside [begin_, end_).
  int64_t offset = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t lo = std::max(offset, begin_), hi = std::min(offset + all[i].numel(), end_);
    if (lo < hi) pieces_.push_back({i, lo - offset, lo - begin_, hi - lo});
    offset += all[i].numel();
  }
  // The parameters become views of the flat buffer, so the all-gather
  // writes the updated values straight into them (no full-size copy).
  at::NoGradGuard no_grad;
  offset = 0;
  for (const auto& p : all) {
    p.set_data(flat_.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

torch::optim::Optimizer& ZeroRedundancyOptimizer::local_optimizer() { return *local_; }

std::map<std::string, torch::Tensor> ZeroRedundancyOptimizer::consolidate_state_dict(int to_rank) {
  DTRAIN_CHECK_ARG(to_rank >= 0 && to_rank < group_->size(), kWho, "::consolidate_state_dict: to_rank ",
                   to_rank, " is not a rank of the group (size ", group_->size(), ")");
  at::NoGradGuard no_grad;
  auto view = checkpoint::detail::param_state(*local_, shard_);
  const bool mine = group_->rank() == to_rank;
  std::map<std::string, torch::Tensor> out;
  const auto& all = param_groups()[0].params();
  for (const auto& [field, slice] : view.tensors) {
    std::vector<at::Tensor> pieces;
    if (mine)
      for (int r = 0; r < group_->size(); ++r) pieces.push_back(at::empty_like(slice));
    group_->gather(pieces, slice.contiguous(), to_rank)->wait();
    if (!mine) continue;
    const auto flat = at::cat(pieces).to(at::kCPU);
    int64_t offset = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      out[std::to_string(i) + "/" + field] = flat.narrow(0, offset, all[i].numel()).view(all[i].sizes()).clone();
      offset += all[i].numel();
    }
  }
  if (mine && view.step.defined()) out["step"] = view.step.clone();
  return out;
}

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  const auto& all = param_groups()[0].params();
  // 1. This rank's slice: current values and gradients (none: zero).
  auto& grad = shard_.mutable_grad();
  if (!grad.defined()) grad = at::zeros_like(shard_);
  grad.zero_();
  for (const auto& piece : pieces_) {
    const auto& p = all[piece.param];
    if (p.grad().defined())
      grad.narrow(0, piece.shard_offset, piece.length)
          .copy_(p.grad().reshape({-1}).narrow(0, piece.param_offset, piece.length));
  }
  // 2. The group's options (a scheduler may have changed lr) go to the local
  //    optimizer, which steps its slice.
  local_->param_groups()[0].set_options(param_groups()[0].options().clone());
  local_->step();
  // 3. Every rank's updated slice into every rank's parameters (views of
  //    flat_). The input is a copy: backends may not read and write one buffer.
  group_->all_gather_into_tensor(flat_, shard_.detach().clone())->wait();
  return loss;
}

}  // namespace dtrain
