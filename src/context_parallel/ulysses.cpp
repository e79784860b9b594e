// Ulysses attention (context_parallel.h): all-to-alls between sequence
// shards of every head and whole sequences of some heads, as autograd
// functions whose backward is the inverse exchange.

#include <torch/autograd.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "common/enforce.h"
#include "context_parallel/sharding.h"
#include "dtrain/context_parallel.h"
#include "tensor_parallel/group.h"

namespace dtrain::context_parallel {
namespace {

using tensor_parallel::detail::group_at;

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

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

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  detail::check_attention_shapes(q, k, v, "attention");
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
                             const std::shared_ptr<ProcessGroup>& group, bool causal, Sharding sharding) {
  const char* what = "ulysses_attention";
  auto g = tensor_parallel::detail::group_or_default(group, what);
  detail::check_attention_shapes(q, k, v, what);
  const int64_t c = g->size(), heads = q.size(1), kv_heads = k.size(1);
  DTRAIN_CHECK_ARG(heads % c == 0, what, ": q's ", heads, " heads do not split over the ", c,
                   " ranks of group '", g->name(), "'");
  DTRAIN_CHECK_ARG(kv_heads % c == 0 || c % kv_heads == 0, what, ": k and v's ", kv_heads,
                   " heads neither split over the ", c, " ranks of group '", g->name(),
                   "' nor divide them (each rank needs whole kv heads)");
  detail::chunk_length(c * q.size(2), c, sharding, what);
  // Fewer kv heads than ranks: each repeated for the ranks whose q heads
  // use it (rank r's q heads [r H/c, (r+1) H/c) read kv head r kv_heads/c).
  const auto widen = [&](const at::Tensor& t) { return kv_heads % c == 0 ? t : t.repeat_interleave(c / kv_heads, 1); };
  const auto address = reinterpret_cast<int64_t>(g.get());
  // The exchange leaves the sequence in rank order (rank 0's part, rank
  // 1's, ...): under head-tail sharding it is put in position order for
  // the mask, and back after.
  at::Tensor to_positions, to_ranks;
  if (sharding == Sharding::kHeadTail && causal && c > 1) {
    to_ranks = at::tensor(detail::gathered_positions(c * q.size(2), c, sharding), at::kLong);
    to_positions = at::argsort(to_ranks);
  }
  const auto gathered = [&](const at::Tensor& t) {
    auto whole = HeadsToSequence::apply(t, address);
    return to_positions.defined() ? whole.index_select(2, to_positions.to(whole.device())) : whole;
  };
  auto out = attention(gathered(q), gathered(widen(k)), gathered(widen(v)), causal);
  if (to_ranks.defined()) out = out.index_select(2, to_ranks.to(out.device()));
  return SequenceToHeads::apply(out, address);
}

}  // namespace dtrain::context_parallel
