// Sequence parallelism's region operations and the marking of parameters
// that live on sequence shards (tensor_parallel.h), as autograd functions
// over the group, along any dimension. The group travels through the
// autograd context as its address, as in regions.cpp.

#include <c10/util/intrusive_ptr.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/enforce.h"
#include "dtrain/tensor_parallel.h"
#include "tensor_parallel/group.h"
#include "tensor_parallel/kept_regions.h"

namespace dtrain::tensor_parallel {
namespace {

using detail::group_at;

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

int64_t sequence_dim(const at::Tensor& x, int64_t dim, const char* what) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  DTRAIN_CHECK_ARG(d >= 0 && d < x.dim(), "tensor_parallel: ", what, ": sequence dimension ", dim,
                   " of a tensor of shape ", x.sizes());
  return d;
}

// Every rank's `x` one after another along `dim`.
at::Tensor sequence_gather(ProcessGroup& g, const at::Tensor& x, int64_t dim) {
  const auto mine = x.movedim(dim, 0).contiguous();
  auto sizes = mine.sizes().vec();
  sizes[0] *= g.size();
  auto out = at::empty(sizes, mine.options());
  g.all_gather_into_tensor(out, mine)->wait();
  return out.movedim(0, dim).contiguous();
}

// The sum over ranks of this rank's slice of `x` along `dim`.
at::Tensor sequence_reduce_scatter(ProcessGroup& g, const at::Tensor& x, int64_t dim,
                                   const char* what) {
  const int64_t whole = x.size(dim);
  DTRAIN_CHECK_ARG(whole % g.size() == 0, "tensor_parallel: ", what, ": the sequence (dimension ",
                   dim, ", ", whole, ") does not split over the ", g.size(), " ranks of group '",
                   g.name(), "'");
  const auto all = x.movedim(dim, 0).contiguous();
  auto sizes = all.sizes().vec();
  sizes[0] /= g.size();
  auto out = at::empty(sizes, all.options());
  g.reduce_scatter_tensor(out, all)->wait();
  return out.movedim(0, dim).contiguous();
}

at::Tensor sequence_slice(ProcessGroup& g, const at::Tensor& x, int64_t dim, const char* what) {
  const int64_t whole = x.size(dim);
  DTRAIN_CHECK_ARG(whole % g.size() == 0, "tensor_parallel: ", what, ": the sequence (dimension ",
                   dim, ", ", whole, ") does not split over the ", g.size(), " ranks of group '",
                   g.name(), "'");
  const int64_t part = whole / g.size();
  return x.narrow(dim, g.rank() * part, part).contiguous();
}

void save(AutogradContext* ctx, int64_t group, int64_t dim) {
  ctx->saved_data["group"] = group;
  ctx->saved_data["dim"] = dim;
}
ProcessGroup& saved_group(AutogradContext* ctx) { return group_at(ctx->saved_data["group"].toInt()); }
int64_t saved_dim(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

struct ScatterToSequence : torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t dim) {
    save(ctx, group, dim);
    return sequence_slice(group_at(group), x, dim, "scatter_to_sequence_region");
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {sequence_gather(saved_group(ctx), grads[0], saved_dim(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t dim) {
    save(ctx, group, dim);
    return sequence_gather(group_at(group), x, dim);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {sequence_reduce_scatter(saved_group(ctx), grads[0], saved_dim(ctx),
                                    "gather_from_sequence_region's gradient"),
            at::Tensor(), at::Tensor()};
  }
};

// With `kept` (a selective checkpoint's, kept_outputs.h), the sum is not
// taken again: the forward's shard of it is handed back.
struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t dim,
                            const at::Tensor* kept) {
    save(ctx, group, dim);
    if (kept) return *kept;
    return sequence_reduce_scatter(group_at(group), x, dim, "reduce_scatter_to_sequence_region");
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {sequence_gather(saved_group(ctx), grads[0], saved_dim(ctx)), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// sum_gradients_together's: the identity forward; the gradients summed
// over the group in one call, flattened, in backward.
struct SumTogether : torch::autograd::Function<SumTogether> {
  // (An at::TensorList, which autograd takes for inputs: a std::vector
  // would pass as a plain argument, without gradients.)
  static tensor_list forward(AutogradContext* ctx, at::TensorList params, int64_t group) {
    ctx->saved_data["group"] = group;
    ctx->set_materialize_grads(false);  // an unused parameter keeps no gradient
    std::vector<int64_t> sizes;
    for (const auto& p : params) sizes.push_back(p.numel());
    ctx->saved_data["numels"] = sizes;
    return params.vec();
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    // One buffer of every parameter's numel (zeros where a gradient is
    // missing: every rank sends the same size), summed in one call.
    const auto numels = ctx->saved_data["numels"].toIntVector();
    at::Tensor like;
    for (const auto& g : grads)
      if (g.defined()) like = g;
    tensor_list out(grads.size() + 1);  // and the group's: none
    if (!like.defined()) return out;    // (no rank reached here with nothing: every rank alike)
    std::vector<at::Tensor> flat;
    for (size_t i = 0; i < grads.size(); ++i)
      flat.push_back(grads[i].defined() ? grads[i].reshape({-1}) : at::zeros({numels[i]}, like.options()));
    auto sum = at::cat(flat);
    saved_group(ctx).all_reduce(sum)->wait();
    int64_t at = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) out[i] = sum.narrow(0, at, numels[i]).view(grads[i].sizes());
      at += numels[i];
    }
    return out;
  }
};

// The parameters whose gradients are summed so far: marked (with the
// group each was marked for), or given to sum_gradients_together
// (together), so that neither takes the other's.
struct Marked {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> param;
  const ProcessGroup* group;
  bool together = false;
};
std::mutex marked_mutex;
std::vector<Marked> marked;

// `param`'s entry, or null (forgetting parameters that are gone); under
// marked_mutex.
const Marked* entry_for(const at::Tensor& param) {
  marked.erase(std::remove_if(marked.begin(), marked.end(), [](const Marked& m) { return m.param.expired(); }),
               marked.end());
  for (const auto& m : marked)
    if (m.param._unsafe_get_target() == param.unsafeGetTensorImpl()) return &m;
  return nullptr;
}

c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> weak(const at::Tensor& p) {
  return c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(p.getIntrusivePtr());
}

}  // namespace

at::Tensor scatter_to_sequence_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group,
                                      int64_t dim) {
  auto g = detail::group_or_default(group, "scatter_to_sequence_region");
  return ScatterToSequence::apply(x, reinterpret_cast<int64_t>(g.get()),
                                  sequence_dim(x, dim, "scatter_to_sequence_region"));
}

at::Tensor gather_from_sequence_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group,
                                       int64_t dim) {
  auto g = detail::group_or_default(group, "gather_from_sequence_region");
  return GatherFromSequence::apply(x, reinterpret_cast<int64_t>(g.get()),
                                   sequence_dim(x, dim, "gather_from_sequence_region"));
}

at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x,
                                             const std::shared_ptr<ProcessGroup>& group,
                                             int64_t dim) {
  auto g = detail::group_or_default(group, "reduce_scatter_to_sequence_region");
  return ReduceScatterToSequence::apply(x, reinterpret_cast<int64_t>(g.get()),
                                        sequence_dim(x, dim, "reduce_scatter_to_sequence_region"), nullptr);
}

at::Tensor detail::reduce_scatter_to_sequence_region_kept(const at::Tensor& x,
                                                         const std::shared_ptr<ProcessGroup>& group,
                                                         int64_t dim, const at::Tensor& kept) {
  return ReduceScatterToSequence::apply(x, detail::group_address(*group), dim, &kept);
}

std::vector<at::Tensor> sum_gradients_together(const std::vector<at::Tensor>& params,
                                               const std::shared_ptr<ProcessGroup>& group) {
  const char* what = "sum_gradients_together";
  auto g = detail::group_or_default(group, what);
  std::vector<at::Tensor> out = params, summed;
  std::vector<size_t> where;
  {
    std::lock_guard<std::mutex> lock(marked_mutex);
    for (size_t i = 0; i < params.size(); ++i) {
      DTRAIN_CHECK_ARG(params[i].defined(), what, ": parameter ", i, " is undefined");
      for (size_t j = 0; j < i; ++j)
        DTRAIN_CHECK_ARG(!params[j].is_same(params[i]), what, ": parameters ", j, " and ", i,
                         " are the same tensor: its gradient would be summed twice");
      const Marked* entry = entry_for(params[i]);
      DTRAIN_CHECK_ARG(entry == nullptr || entry->together, what, ": parameter ", i, " (", params[i].sizes(),
                       ") is marked by mark_sequence_parallel too: its gradient would be summed twice");
      if (entry == nullptr) marked.push_back({weak(params[i]), g.get(), true});
      if (!params[i].requires_grad()) continue;
      if (!summed.empty()) {
        const auto& first = summed[0];
        DTRAIN_CHECK_ARG(params[i].scalar_type() == first.scalar_type() && params[i].device() == first.device(),
                         what, ": parameter ", i, " is ", params[i].scalar_type(), " on ", params[i].device(),
                         " and parameter ", where[0], " ", first.scalar_type(), " on ", first.device(),
                         " (one buffer holds their gradients)");
      }
      summed.push_back(params[i]);
      where.push_back(i);
    }
  }
  if (summed.empty()) return out;
  const auto through = SumTogether::apply(at::TensorList(summed), detail::group_address(*g));
  for (size_t j = 0; j < where.size(); ++j) out[where[j]] = through[j];
  return out;
}

int64_t mark_sequence_parallel(torch::nn::Module& module, const std::shared_ptr<ProcessGroup>& group) {
  auto g = detail::group_or_default(group, "mark_sequence_parallel");
  std::lock_guard<std::mutex> lock(marked_mutex);
  std::vector<at::Tensor> fresh;
  for (const auto& item : module.named_parameters()) {
    const auto& p = item.value();
    const Marked* entry = entry_for(p);
    DTRAIN_CHECK_ARG(entry == nullptr || !entry->together, "mark_sequence_parallel: parameter '", item.key(),
                     "' is given to sum_gradients_together: its gradient would be summed twice");
    const ProcessGroup* before = entry ? entry->group : nullptr;
    DTRAIN_CHECK_ARG(before == nullptr || before == g.get(), "mark_sequence_parallel: parameter '",
                     item.key(), "' is already marked for another group than '", g->name(), "'");
    if (before == nullptr && p.requires_grad()) fresh.push_back(p);
  }
  // The hook holds the group: a marked module keeps its group alive.
  for (auto& p : fresh) {
    p.register_hook([g](const at::Tensor& grad) {
      auto sum = grad.contiguous().clone();
      g->all_reduce(sum)->wait();
      return sum;
    });
    marked.push_back({weak(p), g.get()});
  }
  return static_cast<int64_t>(fresh.size());
}

}  // namespace dtrain::tensor_parallel
