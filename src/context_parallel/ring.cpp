// Ring attention (context_parallel.h): q stays on its rank, k and v go
// around the ring of ranks one hop per step, and each step's block is
// merged into the output with an online softmax (log-sum-exp). The
// backward goes around again, k and v's gradient accumulators travelling
// one hop behind them (on a tag of their own) and arriving home after the
// last step; each step's block gradients are computed while the
// accumulator they join is still on its way.
//
// Blocks are taken chunk by chunk (sharding.h): a q chunk attends a k chunk
// in full when the k chunk comes earlier in the sequence, with the causal
// triangle when it is the same chunk, and not at all when it comes later.
// So under head-tail sharding every rank computes 2c - 1 full blocks and 2
// triangles, whatever its rank.

#include <torch/autograd.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/enforce.h"
#include "context_parallel/sharding.h"
#include "core/internal_tags.h"
#include "dtrain/context_parallel.h"
#include "tensor_parallel/group.h"

namespace dtrain::context_parallel {
namespace {

using tensor_parallel::detail::group_at;

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The ring's geometry and its one hop: what rank r sends to r + 1 and
// receives from r - 1.
struct Ring {
  ProcessGroup& g;
  int64_t ranks, rank;
  Sharding sharding;
  bool causal;

  int64_t source(int64_t step) const { return ((rank - step) % ranks + ranks) % ranks; }

  // Posts the hop of `out` and the receive of what comes in its place; wait
  // on both before reading `in`.
  std::vector<WorkPtr> hop(const at::Tensor& out, const at::Tensor& in) const {
    std::vector<WorkPtr> works{receive(in, dtrain::detail::kRingAttentionTagFromTop)};
    works.push_back(send(out, dtrain::detail::kRingAttentionTagFromTop));
    return works;
  }
  // One half of a hop, on the tag `from_top` places below max_tag().
  WorkPtr receive(const at::Tensor& in, int from_top) const {
    dtrain::detail::InternalTraffic own;
    return g.recv(in, static_cast<int>((rank - 1 + ranks) % ranks), g.max_tag() - from_top);
  }
  WorkPtr send(const at::Tensor& out, int from_top) const {
    dtrain::detail::InternalTraffic own;
    return g.send(out, static_cast<int>((rank + 1) % ranks), g.max_tag() - from_top);
  }

  // How q chunk qc meets k chunk kc: 0 not at all, 1 in full, 2 the triangle.
  int meeting(int64_t qc, int64_t kc) const {
    if (!causal) return 1;
    return kc < qc ? 1 : kc == qc ? 2 : 0;
  }
};

void wait_all(std::vector<WorkPtr>& works) {
  for (auto& w : works) w->wait();
  works.clear();
}

// q [B, Hkv, G, L, D] against k, v [B, Hkv, 1, L, D]: the scaled scores,
// masked above the diagonal when `triangle`.
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, double scale, bool triangle) {
  auto s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (triangle) {
    const int64_t l = s.size(-1);
    s.masked_fill_(at::ones({l, l}, s.options().dtype(at::kBool)).triu(1), -kInf);
  }
  return s;
}

// [B, H, S, D] -> [B, Hkv, G, S, D] (q, its output and their gradients);
// k and v get a 1 in place of G.
at::Tensor grouped(const at::Tensor& t, int64_t kv_heads) {
  return t.reshape({t.size(0), kv_heads, t.size(1) / kv_heads, t.size(2), t.size(3)});
}

// One rank's q chunks, each with its running output and log-sum-exp.
struct Partial {
  std::vector<at::Tensor> out, lse;  // per q chunk: [B, Hkv, G, L, D], [B, Hkv, G, L]

  void merge(size_t i, const at::Tensor& block_out, const at::Tensor& block_lse) {
    if (!out[i].defined()) {
      out[i] = block_out;
      lse[i] = block_lse;
      return;
    }
    auto both = at::logaddexp(lse[i], block_lse);
    out[i] = out[i] * (lse[i] - both).exp().unsqueeze(-1) + block_out * (block_lse - both).exp().unsqueeze(-1);
    lse[i] = both;
  }
};

struct RingForward {
  at::Tensor out, lse;  // [B, H, S, D] in q's dtype, [B, Hkv, G, S] float
};

// Every block this rank computes, step by step around the ring: k and v
// (one tensor [2, B, Hkv, S, D]: one message per hop) are posted on to the
// next rank, then visit(i, j, how, kv) runs for each q chunk i of this
// rank and k chunk j held that meet (Ring::meeting), then after(step);
// then the k and v that came in are taken.
template <typename Visit, typename After>
void around_the_ring(const Ring& ring, at::Tensor kv, const Visit& visit, const After& after) {
  const auto mine = detail::chunks_of(ring.rank, ring.ranks, ring.sharding);
  at::Tensor next;
  std::vector<WorkPtr> inflight;
  for (int64_t step = 0; step < ring.ranks; ++step) {
    const bool more = step + 1 < ring.ranks;
    if (more) {
      next = at::empty_like(kv);
      inflight = ring.hop(kv, next);
    }
    const auto theirs = detail::chunks_of(ring.source(step), ring.ranks, ring.sharding);
    for (size_t i = 0; i < mine.size(); ++i)
      for (size_t j = 0; j < theirs.size(); ++j)
        if (const int how = ring.meeting(mine[i], theirs[j]))
          visit(static_cast<int64_t>(i), static_cast<int64_t>(j), how, kv);
    after(step);
    if (more) {
      wait_all(inflight);
      kv = next;
    }
  }
}

// The sizes every pass needs: chunk length, kv heads, the scale.
struct Dims {
  int64_t chunk, kv_heads;
  double scale;
  Dims(const Ring& ring, const at::Tensor& q, const at::Tensor& k)
      : chunk(q.size(2) / detail::chunks_per_rank(ring.sharding)),
        kv_heads(k.size(1)),
        scale(1.0 / std::sqrt(static_cast<double>(q.size(3)))) {}
  // Rows of q chunk i (dimension 3 of [B, Hkv, G, S, ...]) and columns of
  // k chunk j (dimension 2 of [B, Hkv, S, D]).
  at::Tensor rows(const at::Tensor& t, int64_t i) const { return t.narrow(3, i * chunk, chunk); }
  at::Tensor cols(const at::Tensor& t, int64_t j) const { return t.narrow(2, j * chunk, chunk); }
};

at::Tensor stacked(const at::Tensor& k, const at::Tensor& v) { return at::stack({k, v}).to(at::kFloat).contiguous(); }

RingForward ring_forward(const Ring& ring, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const Dims dims(ring, q, k);
  const auto qf = grouped(q.to(at::kFloat), dims.kv_heads);
  const size_t chunks = static_cast<size_t>(detail::chunks_per_rank(ring.sharding));
  Partial partial{std::vector<at::Tensor>(chunks), std::vector<at::Tensor>(chunks)};
  around_the_ring(
      ring, stacked(k, v),
      [&](int64_t i, int64_t j, int how, const at::Tensor& kv) {
        const auto kj = dims.cols(kv[0], j).unsqueeze(2), vj = dims.cols(kv[1], j).unsqueeze(2);
        const auto s = scores(dims.rows(qf, i), kj, dims.scale, how == 2);
        const auto block_lse = at::logsumexp(s, -1);
        partial.merge(static_cast<size_t>(i), at::matmul((s - block_lse.unsqueeze(-1)).exp(), vj), block_lse);
      },
      [](int64_t) {});
  const auto out = at::cat(partial.out, 3);
  return {out.reshape(q.sizes()).to(q.scalar_type()), at::cat(partial.lse, 3)};
}

// The gradients of q, k and v given the output's.
tensor_list ring_backward(const Ring& ring, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad_out) {
  const Dims dims(ring, q, k);
  const auto qf = grouped(q.to(at::kFloat), dims.kv_heads);
  const auto dout = grouped(grad_out.to(at::kFloat), dims.kv_heads);
  // D_i = rowsum(dO_i * O_i): the softmax's backward, per query.
  const auto delta = (dout * grouped(out.to(at::kFloat), dims.kv_heads)).sum(-1);
  auto dq = at::zeros_like(qf);
  // The gradients of the k and v held: this step's blocks' (dkv) are
  // computed while the accumulator of the earlier ranks' (coming from
  // rank - 1 one hop behind k and v) travels, then added to it and sent on
  // to rank + 1 while the next step computes. The last hop brings every
  // rank its own.
  const auto zeros = [&] {
    return at::zeros({2, k.size(0), k.size(1), k.size(2), k.size(3)}, k.options().dtype(at::kFloat));
  };
  const int tag = dtrain::detail::kRingGradientTagFromTop;
  at::Tensor dkv = zeros(), arriving, leaving;
  WorkPtr incoming, outgoing;
  around_the_ring(
      ring, stacked(k, v),
      [&](int64_t i, int64_t j, int how, const at::Tensor& kv) {
        const auto qi = dims.rows(qf, i), doi = dims.rows(dout, i);
        const auto kj = dims.cols(kv[0], j).unsqueeze(2), vj = dims.cols(kv[1], j).unsqueeze(2);
        const auto p = (scores(qi, kj, dims.scale, how == 2) - dims.rows(lse, i).unsqueeze(-1)).exp();
        const auto ds = p * (at::matmul(doi, vj.transpose(-2, -1)) - dims.rows(delta, i).unsqueeze(-1));
        dims.rows(dq, i).add_(at::matmul(ds, kj), dims.scale);
        dims.cols(dkv[0], j).add_(at::matmul(ds.transpose(-2, -1), qi).sum(2), dims.scale);
        dims.cols(dkv[1], j).add_(at::matmul(p.transpose(-2, -1), doi).sum(2));
      },
      [&](int64_t step) {
        if (ring.ranks == 1) return;
        if (step > 0) {  // the earlier ranks' part of these k and v's gradients
          incoming->wait();
          dkv.add_(arriving);
        }
        if (outgoing) outgoing->wait();  // (the last accumulator sent, before its buffer goes)
        leaving = dkv;
        outgoing = ring.send(leaving, tag);
        arriving = at::empty_like(dkv);
        incoming = ring.receive(arriving, tag);  // the next step's, or at the end this rank's own
        if (step + 1 < ring.ranks) dkv = zeros();
      });
  if (ring.ranks > 1) {
    incoming->wait();
    outgoing->wait();
    dkv = arriving;
  }
  return {dq.reshape(q.sizes()).to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type())};
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t group, bool causal, int64_t sharding) {
    ProcessGroup& g = group_at(group);
    const Ring ring{g, g.size(), g.rank(), static_cast<Sharding>(sharding), causal};
    auto result = ring_forward(ring, q, k, v);
    ctx->save_for_backward({q, k, v, result.out, result.lse});
    ctx->saved_data["group"] = group;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["sharding"] = sharding;
    return result.out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    ProcessGroup& g = group_at(ctx->saved_data["group"].toInt());
    const Ring ring{g, g.size(), g.rank(), static_cast<Sharding>(ctx->saved_data["sharding"].toInt()),
                    ctx->saved_data["causal"].toBool()};
    const auto saved = ctx->get_saved_variables();
    auto d = ring_backward(ring, saved[0], saved[1], saved[2], saved[3], saved[4], grads[0]);
    return {d[0], d[1], d[2], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::shared_ptr<ProcessGroup>& group, bool causal, Sharding sharding) {
  const char* what = "ring_attention";
  auto g = tensor_parallel::detail::group_or_default(group, what);
  detail::check_attention_shapes(q, k, v, what);
  detail::chunk_length(g->size() * q.size(2), g->size(), sharding, what);
  return RingAttention::apply(q, k, v, reinterpret_cast<int64_t>(g.get()), causal,
                              static_cast<int64_t>(sharding));
}

}  // namespace dtrain::context_parallel
