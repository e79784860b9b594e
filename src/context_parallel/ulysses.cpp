// Ulysses attention (context_parallel.h): all-to-alls between sequence
// shards of every head and whole sequences of some heads, as autograd
// functions whose backward is the inverse exchange.

#include <torch/autograd.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "common/enforce.h"
#include "dtrain/context_parallel.h"
#include "tensor_parallel/group.h"

namespace dtrain::context_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

ProcessGroup& group_at(int64_t address) { return *reinterpret_cast<ProcessGroup*>(address); }

// Sends chunk j of dimension 0 of `x` ([c, ...], contiguous) to rank j;
// returns [c, ...] with chunk j from rank j.
at::Tensor exchange(const at::Tensor& x, ProcessGroup& group) {
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  group.all_to_all(out.unbind(0), in.unbind(0))->wait();
  return out;
}

// [B, H, s, D], sequence shard of every head -> [B, H / c, c s, D], whole
// sequence of this rank's heads.
at::Tensor heads_to_sequence(const at::Tensor& x, ProcessGroup& g) {
  const int64_t c = g.size(), b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  auto sent = x.reshape({b, c, h / c, s, d}).permute({1, 0, 2, 3, 4});
  return exchange(sent, g).permute({1, 2, 0, 3, 4}).reshape({b, h / c, c * s, d});
}

// The inverse: [B, h, c s, D] -> [B, c h, s, D].
at::Tensor sequence_to_heads(const at::Tensor& x, ProcessGroup& g) {
  const int64_t c = g.size(), b = x.size(0), h = x.size(1), s = x.size(2) / c, d = x.size(3);
  auto sent = x.reshape({b, h, c, s, d}).permute({2, 0, 1, 3, 4});
  return exchange(sent, g).permute({1, 0, 2, 3, 4}).reshape({b, c * h, s, d});
}

// One direction of the exchange as an autograd function: its backward is
// the other direction.
template <bool kToSequence>
struct Exchange : torch::autograd::Function<Exchange<kToSequence>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return kToSequence ? heads_to_sequence(x, group_at(group)) : sequence_to_heads(x, group_at(group));
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    ProcessGroup& g = group_at(ctx->saved_data["group"].toInt());
    return {kToSequence ? sequence_to_heads(grads[0], g) : heads_to_sequence(grads[0], g), at::Tensor()};
  }
};
using HeadsToSequence = Exchange<true>;
using SequenceToHeads = Exchange<false>;

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* what) {
  DTRAIN_CHECK_ARG(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, what,
                   ": q, k and v must be [batch, heads, seq, head_dim], got ", q.sizes(), ", ", k.sizes(),
                   " and ", v.sizes());
  DTRAIN_CHECK_ARG(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                       k.size(3) == q.size(3),
                   what, ": k and v must be [", q.size(0), ", kv_heads, ", q.size(2), ", ", q.size(3),
                   "] beside q ", q.sizes(), ", got ", k.sizes(), " and ", v.sizes());
  DTRAIN_CHECK_ARG(k.size(1) > 0 && q.size(1) % k.size(1) == 0, what, ": q's ", q.size(1),
                   " heads are not a multiple of k and v's ", k.size(1));
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  check_shapes(q, k, v, "attention");
  const int64_t group = q.size(1) / k.size(1), s = q.size(2);
  const auto keys = group == 1 ? k : k.repeat_interleave(group, 1);
  const auto values = group == 1 ? v : v.repeat_interleave(group, 1);
  auto scores = at::matmul(q, keys.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  if (causal) {
    const auto above = at::ones({s, s}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(above, -std::numeric_limits<double>::infinity());
  }
  return at::matmul(at::softmax(scores, -1), values);
}

at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::shared_ptr<ProcessGroup>& group, bool causal) {
  const char* what = "ulysses_attention";
  auto g = tensor_parallel::detail::group_or_default(group, what);
  check_shapes(q, k, v, what);
  const int64_t c = g->size(), heads = q.size(1), kv_heads = k.size(1);
  DTRAIN_CHECK_ARG(heads % c == 0, what, ": q's ", heads, " heads do not split over the ", c,
                   " ranks of group '", g->name(), "'");
  DTRAIN_CHECK_ARG(kv_heads % c == 0 || c % kv_heads == 0, what, ": k and v's ", kv_heads,
                   " heads neither split over the ", c, " ranks of group '", g->name(),
                   "' nor divide them (each rank needs whole kv heads)");
  // Fewer kv heads than ranks: each repeated for the ranks whose q heads
  // use it (rank r's q heads [r H/c, (r+1) H/c) read kv head r kv_heads/c).
  const auto widen = [&](const at::Tensor& t) { return kv_heads % c == 0 ? t : t.repeat_interleave(c / kv_heads, 1); };
  const auto address = reinterpret_cast<int64_t>(g.get());
  const auto out = attention(HeadsToSequence::apply(q, address), HeadsToSequence::apply(widen(k), address),
                             HeadsToSequence::apply(widen(v), address), causal);
  return SequenceToHeads::apply(out, address);
}

}  // namespace dtrain::context_parallel
