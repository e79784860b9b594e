// The token dispatch of expert_parallel.h: a token's rows (one per chosen
// expert) sorted by expert, sent to the experts' ranks by all-to-all,
// regrouped there expert by expert, run, and brought back the same way;
// then weighted by the router's scores and summed per token. Only the
// all-to-all is an autograd function of ours; the sorting and regrouping
// are index_select, whose gradients libtorch knows.

#include <torch/autograd.h>
#include <torch/torch.h>

#include <numeric>

#include "common/enforce.h"
#include "common/rethrow.h"
#include "diagnostics/op_label.h"
#include "tensor_parallel/group.h"
#include "dtrain/expert_parallel.h"

namespace dtrain::expert_parallel {
namespace {

using tensor_parallel::detail::group_at;

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// `t`'s dim-0 rows cut by `splits`: views.
std::vector<at::Tensor> pieces(const at::Tensor& t, const std::vector<int64_t>& splits) {
  std::vector<at::Tensor> out;
  int64_t at_row = 0;
  for (int64_t n : splits) out.push_back(t.narrow(0, at_row, n)), at_row += n;
  return out;
}

// Rows of `x` sent in `in_splits` pieces, one per rank, and received in
// `out_splits` pieces (all_to_all_single's).
at::Tensor exchange_rows(const at::Tensor& x, const std::vector<int64_t>& out_splits,
                         const std::vector<int64_t>& in_splits, ProcessGroup& group) {
  auto sizes = x.sizes().vec();
  sizes[0] = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  at::Tensor out = at::empty(sizes, x.options());
  const at::Tensor in = x.contiguous();
  try {
    group.all_to_all(pieces(out, out_splits), pieces(in, in_splits))->wait();
  } catch (const Error&) {  // which layer's exchange failed: its label
    const std::string& label = dtrain::detail::OpLabel::current();
    if (label.empty()) throw;
    dtrain::detail::rethrow_with(label + ": ");
  }
  return out;
}

// The flight recorder's label of one of a layer's all-to-alls ("<layer>:
// <what>"), after the thread's label where it has one.
std::string label_of(const std::string& text) {
  const std::string& outer = dtrain::detail::OpLabel::current();
  return outer.empty() ? text : outer + ", " + text;
}

// The rows' all-to-all as an autograd function; the backward sends the
// gradients the other way. The group travels through the autograd context
// as its address (the MoE module holds it until backward), and the label
// by name: `what` is "dispatch" or "combine".
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> out_splits,
                            std::vector<int64_t> in_splits, int64_t group, const std::string& layer,
                            const std::string& what) {
    ctx->saved_data["out"] = out_splits;
    ctx->saved_data["in"] = in_splits;
    ctx->saved_data["group"] = group;
    ctx->saved_data["label"] = layer + ": " + what + ", backward";
    dtrain::detail::OpLabel label(label_of(layer + ": " + what));
    return exchange_rows(x, out_splits, in_splits, group_at(group));
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto out = ctx->saved_data["out"].toIntVector(), in = ctx->saved_data["in"].toIntVector();
    const std::string& mine = ctx->saved_data["label"].toStringRef();
    dtrain::detail::OpLabel label(label_of(mine));
    return {exchange_rows(grads[0], in, out, group_at(ctx->saved_data["group"].toInt())), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const auto c = t.to(at::kCPU).to(at::kLong).contiguous();  // (counts may live on a GPU)
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

at::Tensor index_tensor(const std::vector<int64_t>& v, c10::Device device = c10::kCPU) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(device);
}

// The rows this rank routed (sorted by global expert, `counts` per expert)
// through the experts' ranks and back, in the same order.
at::Tensor through_ranks(const at::Tensor& routed, const std::vector<int64_t>& counts, GroupedExpertsImpl& experts,
                         const std::shared_ptr<ProcessGroup>& group, const std::string& layer) {
  const int world = group->size();
  const int64_t local = experts.local_experts();
  // How many rows each rank sends each of this rank's experts.
  std::vector<int64_t> received_counts;
  {
    dtrain::detail::OpLabel label(label_of(layer + ": counts"));
    received_counts = to_vector(exchange_rows(index_tensor(counts), std::vector<int64_t>(world, local),
                                              std::vector<int64_t>(world, local), *group));
  }
  std::vector<int64_t> in_splits(world, 0), out_splits(world, 0), per_expert(local, 0);
  for (int p = 0; p < world; ++p)
    for (int64_t j = 0; j < local; ++j) {
      const int64_t n = received_counts[p * local + j];
      DTRAIN_CHECK_ARG(n >= 0 && n <= (int64_t{1} << 40), "expert_parallel::MoE: rank ", p, " of group '",
                       group->name(), "' announced ", n, " rows for expert ", experts.first_expert() + j);
      in_splits[p] += counts[p * local + j];
      out_splits[p] += n;
      per_expert[j] += n;
    }
  const auto address = reinterpret_cast<int64_t>(group.get());
  at::Tensor received = AllToAllRows::apply(routed, out_splits, in_splits, address, layer, "dispatch");
  // Received source by source, each expert by expert: regroup expert by
  // expert, each source by source.
  std::vector<int64_t> start(world * local), order;
  order.reserve(received.size(0));
  int64_t at_row = 0;
  for (int64_t i = 0; i < world * local; ++i) {
    start[i] = at_row;
    at_row += received_counts[i];
  }
  for (int64_t j = 0; j < local; ++j)
    for (int64_t p = 0; p < world; ++p)
      for (int64_t i = 0; i < received_counts[p * local + j]; ++i) order.push_back(start[p * local + j] + i);
  std::vector<int64_t> back(order.size());
  for (size_t i = 0; i < order.size(); ++i) back[order[i]] = static_cast<int64_t>(i);
  at::Tensor out = experts.forward(received.index_select(0, index_tensor(order, received.device())), per_expert);
  return AllToAllRows::apply(out.index_select(0, index_tensor(back, out.device())), in_splits, out_splits, address,
                             layer, "combine");
}

}  // namespace

at::Tensor dispatch_and_combine(const at::Tensor& x, const Routing& routing, GroupedExpertsImpl& experts,
                                const std::shared_ptr<ProcessGroup>& group, const std::string& name) {
  const int64_t top_k = routing.experts.size(1);
  const at::Tensor order = std::get<1>(at::sort(routing.experts.reshape(-1), /*stable=*/true, 0, false));
  const at::Tensor token_of = at::div(order, top_k, "floor");
  const at::Tensor routed = x.index_select(0, token_of);
  const auto counts = to_vector(routing.tokens_per_expert);
  const bool spread = group && group->size() > 1;
  DTRAIN_CHECK_ARG(std::accumulate(counts.begin(), counts.end(), int64_t{0}) == routed.size(0),
                   "expert_parallel::MoE: the routing counts ", routed.size(0), " rows as ",
                   std::accumulate(counts.begin(), counts.end(), int64_t{0}));
  const at::Tensor y = spread ? through_ranks(routed, counts, experts, group, name) : experts.forward(routed, counts);
  const at::Tensor weights = routing.scores.reshape(-1).index_select(0, order).unsqueeze(1).to(y.scalar_type());
  return at::zeros_like(x).index_add(0, token_of, y * weights);
}

}  // namespace dtrain::expert_parallel
