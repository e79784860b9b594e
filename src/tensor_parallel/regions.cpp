// The tensor-parallel region operations (tensor_parallel.h), as autograd
// functions. The group travels through the autograd context as its address:
// the caller keeps it alive until backward (the modules hold theirs).

#include <torch/autograd.h>

#include <cstdint>
#include <vector>

#include "common/enforce.h"
#include "dtrain/tensor_parallel.h"
#include "tensor_parallel/kept_regions.h"

namespace dtrain::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

ProcessGroup& region_group(AutogradContext* ctx) {
  return *reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
}

int64_t group_address(const std::shared_ptr<ProcessGroup>& group) {
  DTRAIN_CHECK_ARG(group, "tensor_parallel: no group (and no default group)");
  return reinterpret_cast<int64_t>(group.get());
}

at::Tensor region_sum(ProcessGroup& g, const at::Tensor& t) {
  auto out = t.contiguous().clone();
  g.all_reduce(out)->wait();
  return out;
}

// Every rank's `t` side by side along the last dimension.
at::Tensor region_gather(ProcessGroup& g, const at::Tensor& t) {
  const auto mine = t.contiguous();
  std::vector<at::Tensor> parts;
  for (int r = 0; r < g.size(); ++r) parts.push_back(at::empty_like(mine));
  g.all_gather(parts, mine)->wait();
  return at::cat(parts, -1);
}

// This rank's slice of the last dimension.
at::Tensor region_slice(ProcessGroup& g, const at::Tensor& t, const char* what) {
  const int64_t whole = t.size(-1);
  DTRAIN_CHECK_ARG(whole % g.size() == 0, "tensor_parallel: ", what, ": the last dimension (",
                   whole, ") does not split over the ", g.size(), " ranks of group '", g.name(),
                   "'");
  const int64_t part = whole / g.size();
  return t.narrow(-1, g.rank() * part, part).contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {region_sum(region_group(ctx), grads[0]), at::Tensor()};
  }
};

// With `kept` (a selective checkpoint's, kept_outputs.h), the sum is not
// taken again: the forward's is handed back.
struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t group, const at::Tensor* kept) {
    return kept ? *kept : region_sum(*reinterpret_cast<ProcessGroup*>(group), x);
  }
  static tensor_list backward(AutogradContext*, tensor_list grads) {
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return region_gather(*reinterpret_cast<ProcessGroup*>(group), x);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {region_slice(region_group(ctx), grads[0], "gather_from_region's gradient"), at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return region_slice(*reinterpret_cast<ProcessGroup*>(group), x, "scatter_to_region");
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {region_gather(region_group(ctx), grads[0]), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  return CopyToRegion::apply(x, group_address(group));
}
at::Tensor reduce_from_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  return ReduceFromRegion::apply(x, group_address(group), nullptr);
}
at::Tensor gather_from_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  return GatherFromRegion::apply(x, group_address(group));
}
at::Tensor scatter_to_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  return ScatterToRegion::apply(x, group_address(group));
}

namespace detail {

at::Tensor reduce_from_region_kept(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group,
                                   const at::Tensor& kept) {
  return ReduceFromRegion::apply(x, group_address(group), &kept);
}

}  // namespace detail
}  // namespace dtrain::tensor_parallel
