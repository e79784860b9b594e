#include "dtrain/optim/zero_redundancy_optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (its own header on libtorch 2.x)

#include <algorithm>
#include <deque>

#include "common/enforce.h"
#include "optim/optimizer_state.h"
#include "core/storage_alias.h"
#include "ddp/sharded_gradients.h"
#include "dtrain/ddp.h"
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

// ZeRO-1: one segment over the parameters in order.
ZeroRedundancyOptimizer::Parts ZeroRedundancyOptimizer::prepare(
    const std::vector<torch::Tensor>& params, const Factory& make_local,
    const ZeroRedundancyOptions& options) {
  check_params(params);
  Parts parts;
  parts.group = options.process_group() ? options.process_group() : default_group();
  DTRAIN_CHECK_ARG(parts.group && parts.group->rank() >= 0, kWho,
                   ": this rank is not a member of the group");
  parts.segments.push_back({0, slice_length(total_numel(params), parts.group->size())});
  int64_t offset = 0;
  for (const auto& p : params) {
    parts.param_offsets.push_back(offset);
    offset += p.numel();
  }
  finish_parts(parts, params, make_local);
  return parts;
}

// ZeRO-2: one segment per DDP bucket, the bucket's members in its order.
ZeroRedundancyOptimizer::Parts ZeroRedundancyOptimizer::prepare_sharded(detail::DDPCore& ddp,
                                                                        const Factory& make_local) {
  auto link = ddp.sharded_gradients();
  DTRAIN_CHECK_ARG(link != nullptr, kWho,
                   "(ddp, factory): the DDP was built without DDPOptions().shard_gradients(true) "
                   "(for ZeRO-1 over a plain DDP pass ddp.parameters())");
  DTRAIN_CHECK_ARG(!link->attached, kWho,
                   "(ddp, factory): this DDP already has a ZeroRedundancyOptimizer stepping on "
                   "its gradient shares");
  const auto& params = ddp.parameters();
  check_params(params);
  Parts parts;
  parts.group = ddp.shared_group();
  parts.link = link;
  parts.param_offsets.assign(params.size(), 0);
  for (const auto& bucket : link->buckets) {
    parts.segments.push_back({bucket.shard_offset, bucket.slice});
    int64_t offset = bucket.shard_offset * link->world;
    for (size_t i : bucket.members) {
      parts.param_offsets[i] = offset;
      offset += params[i].numel();
    }
  }
  finish_parts(parts, params, make_local);
  return parts;
}

// The flat buffer holding the parameters' values, this rank's slices of
// it, and the local optimizer over those slices (no copies of their own).
void ZeroRedundancyOptimizer::finish_parts(Parts& parts, const std::vector<torch::Tensor>& params,
                                           const Factory& make_local) {
  DTRAIN_CHECK_ARG(static_cast<bool>(make_local), kWho, ": the local optimizer factory is empty");
  const int world = parts.group->size(), rank = parts.group->rank();
  at::NoGradGuard no_grad;
  const auto& last = parts.segments.back();
  parts.flat = at::zeros({(last.shard_offset + last.slice) * world},
                         params.front().options().requires_grad(false));
  for (size_t i = 0; i < params.size(); ++i)
    parts.flat.narrow(0, parts.param_offsets[i], params[i].numel()).copy_(params[i].detach().reshape({-1}));
  for (const auto& seg : parts.segments)
    parts.shards.push_back(parts.flat.narrow(0, seg.shard_offset * world + rank * seg.slice, seg.slice));
  parts.local = make_local(parts.shards);
  DTRAIN_CHECK_ARG(parts.local != nullptr, kWho, ": the factory returned no optimizer");
  bool same = parts.local->param_groups().size() == 1 &&
              parts.local->param_groups()[0].params().size() == parts.shards.size();
  for (size_t k = 0; same && k < parts.shards.size(); ++k)
    same = parts.local->param_groups()[0].params()[k].is_same(parts.shards[k]);
  DTRAIN_CHECK_ARG(same, kWho, ": the factory must build its optimizer over the ",
                   parts.shards.size(), " tensor(s) it is given, as one parameter group");
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                                                 const Factory& make_local,
                                                 ZeroRedundancyOptions options)
    : ZeroRedundancyOptimizer(params, prepare(params, make_local, options)) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(detail::DDPCore& ddp, const Factory& make_local)
    : ZeroRedundancyOptimizer(ddp.parameters(), prepare_sharded(ddp, make_local)) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, Parts parts)
    : torch::optim::Optimizer(params, parts.local->param_groups()[0].options().clone()),
      group_(std::move(parts.group)),
      segments_(std::move(parts.segments)),
      param_offsets_(std::move(parts.param_offsets)),
      flat_(std::move(parts.flat)),
      shards_(std::move(parts.shards)),
      local_(std::move(parts.local)),
      link_(std::move(parts.link)) {
  const auto& all = param_groups()[0].params();
  total_ = total_numel(all);
  const int world = group_->size(), rank = group_->rank();
  // The piece of each parameter inside this rank's slice of its segment.
  for (size_t i = 0; i < all.size(); ++i) {
    for (size_t s = 0; s < segments_.size(); ++s) {
      const int64_t start = segments_[s].shard_offset * world + rank * segments_[s].slice;
      const int64_t lo = std::max(param_offsets_[i], start);
      const int64_t hi = std::min(param_offsets_[i] + all[i].numel(), start + segments_[s].slice);
      if (lo < hi) pieces_.push_back({i, lo - param_offsets_[i], s, lo - start, hi - lo});
    }
  }
  // The parameters become views of the flat buffer, so the all-gathers
  // write the updated values straight into them (no full-size copy).
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < all.size(); ++i)
    all[i].set_data(flat_.narrow(0, param_offsets_[i], all[i].numel()).view(all[i].sizes()));
  if (link_) link_->attached = true;
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() {
  if (link_) link_->attached = false;
}

int64_t ZeroRedundancyOptimizer::shard_begin() const {
  DTRAIN_CHECK_ARG(!link_, kWho, "::shard_begin: over a sharded DDP this rank's share is one "
                                 "slice per bucket (see pieces())");
  return std::min<int64_t>(total_, segments_[0].slice * group_->rank());
}

int64_t ZeroRedundancyOptimizer::shard_end() const {
  return std::min<int64_t>(total_, shard_begin() + segments_[0].slice);
}

torch::optim::Optimizer& ZeroRedundancyOptimizer::local_optimizer() { return *local_; }

std::map<std::string, torch::Tensor> ZeroRedundancyOptimizer::consolidate_state_dict(int to_rank) {
  DTRAIN_CHECK_ARG(to_rank >= 0 && to_rank < group_->size(), kWho, "::consolidate_state_dict: to_rank ",
                   to_rank, " is not a rank of the group (size ", group_->size(), ")");
  at::NoGradGuard no_grad;
  const int world = group_->size();
  const bool mine = group_->rank() == to_rank;
  std::vector<optim::detail::ParamStateView> views;
  for (const auto& shard : shards_) views.push_back(optim::detail::param_state(*local_, shard));
  std::map<std::string, torch::Tensor> out;
  const auto& all = param_groups()[0].params();
  for (size_t f = 0; f < views[0].tensors.size(); ++f) {
    const std::string& field = views[0].tensors[f].first;
    // Laid out like flat_: every rank's slice of every segment.
    at::Tensor full = mine ? at::empty_like(flat_) : at::Tensor();
    for (size_t s = 0; s < segments_.size(); ++s) {
      const at::Tensor& slice = views[s].tensors.at(f).second;
      std::vector<at::Tensor> pieces;
      if (mine)
        for (int r = 0; r < world; ++r)
          pieces.push_back(full.narrow(0, (segments_[s].shard_offset * world) + r * segments_[s].slice,
                                       segments_[s].slice));
      group_->gather(pieces, slice.contiguous(), to_rank)->wait();
    }
    if (!mine) continue;
    full = full.to(at::kCPU);
    for (size_t i = 0; i < all.size(); ++i)
      out[std::to_string(i) + "/" + field] =
          full.narrow(0, param_offsets_[i], all[i].numel()).view(all[i].sizes()).clone();
  }
  if (mine && views[0].step.defined()) out["step"] = views[0].step.clone();
  return out;
}

// This rank's gradient slices. ZeRO-1: copied from the parameters'
// .grad (none: zero). ZeRO-2: DDP's shares, used in place.
void ZeroRedundancyOptimizer::gradients_in() {
  if (link_) {
    if (!link_->pending) link_->grad.zero_();  // no synchronized backward since the last step
    for (size_t s = 0; s < shards_.size(); ++s) {
      auto& grad = shards_[s].mutable_grad();
      if (!grad.defined() || !grad.is_alias_of(link_->grad))  // zero_grad(set_to_none) dropped it
        grad = detail::storage_alias(link_->grad, segments_[s].shard_offset, {segments_[s].slice});
    }
    return;
  }
  const auto& all = param_groups()[0].params();
  for (auto& shard : shards_) {
    auto& grad = shard.mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(shard);
    grad.zero_();
  }
  for (const auto& piece : pieces_) {
    const auto& p = all[piece.param];
    if (p.grad().defined())
      shards_[piece.shard].mutable_grad().narrow(0, piece.shard_offset, piece.length)
          .copy_(p.grad().reshape({-1}).narrow(0, piece.param_offset, piece.length));
  }
}

// Every rank's updated slices into every rank's parameters (views of
// flat_). The inputs are copies: backends may not read and write one
// buffer. At most two segments in flight, so the copies stay small.
void ZeroRedundancyOptimizer::gather_updated() {
  const int world = group_->size();
  std::deque<WorkPtr> in_flight;
  for (size_t s = 0; s < segments_.size(); ++s) {
    if (in_flight.size() == 2) {
      in_flight.front()->wait();
      in_flight.pop_front();
    }
    in_flight.push_back(group_->all_gather_into_tensor(
        flat_.narrow(0, segments_[s].shard_offset * world, segments_[s].slice * world),
        shards_[s].detach().clone()));
  }
  for (auto& work : in_flight) work->wait();
}

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  gradients_in();
  // The group's options (a scheduler may have changed lr) go to the local
  // optimizer, which steps its slices.
  local_->param_groups()[0].set_options(param_groups()[0].options().clone());
  local_->step();
  gather_updated();
  if (link_) link_->pending = false;
  return loss;
}

}  // namespace dtrain
