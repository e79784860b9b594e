// Ring attention (context_parallel.h): q stays on its rank, k and v go
// around the ring of ranks one hop per step, and each step's block is
// merged into the output with an online softmax (log-sum-exp). The
// backward goes around again, k and v's gradient accumulators travelling
// with them and arriving home after the last step.
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
    dtrain::detail::InternalTraffic own;
    const int tag = g.max_tag() - dtrain::detail::kRingAttentionTagFromTop;
    std::vector<WorkPtr> works;
    works.push_back(g.recv(in, static_cast<int>((rank - 1 + ranks) % ranks), tag));
    works.push_back(g.send(out, static_cast<int>((rank + 1) % ranks), tag));
    return works;
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

// k and v as one tensor [2, B, Hkv, S, D]: one message per hop.
RingForward ring_forward(const Ring& ring, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t kv_heads = k.size(1), chunks = detail::chunks_per_rank(ring.sharding);
  const int64_t l = q.size(2) / chunks;
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const auto qf = grouped(q.to(at::kFloat), kv_heads);
  const auto mine = detail::chunks_of(ring.rank, ring.ranks, ring.sharding);
  at::Tensor kv = at::stack({k, v}).to(at::kFloat).contiguous(), next;
  Partial partial{std::vector<at::Tensor>(mine.size()), std::vector<at::Tensor>(mine.size())};
  std::vector<WorkPtr> inflight;
  for (int64_t step = 0; step < ring.ranks; ++step) {
    if (step + 1 < ring.ranks) {
      next = at::empty_like(kv);
      inflight = ring.hop(kv, next);
    }
    const auto theirs = detail::chunks_of(ring.source(step), ring.ranks, ring.sharding);
    for (size_t i = 0; i < mine.size(); ++i) {
      const auto qi = qf.narrow(3, static_cast<int64_t>(i) * l, l);
      for (size_t j = 0; j < theirs.size(); ++j) {
        const int how = ring.meeting(mine[i], theirs[j]);
        if (how == 0) continue;
        const auto kj = kv[0].narrow(2, static_cast<int64_t>(j) * l, l).unsqueeze(2);
        const auto vj = kv[1].narrow(2, static_cast<int64_t>(j) * l, l).unsqueeze(2);
        const auto s = scores(qi, kj, scale, how == 2);
        const auto block_lse = at::logsumexp(s, -1);
        partial.merge(i, at::matmul((s - block_lse.unsqueeze(-1)).exp(), vj), block_lse);
      }
    }
    if (step + 1 < ring.ranks) {
      wait_all(inflight);
      kv = next;
    }
  }
  const auto out = at::cat(partial.out, 3);
  return {out.reshape(q.sizes()).to(q.scalar_type()), at::cat(partial.lse, 3)};
}

// The gradients of q, k and v given the output's.
tensor_list ring_backward(const Ring& ring, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad_out) {
  const int64_t kv_heads = k.size(1), chunks = detail::chunks_per_rank(ring.sharding);
  const int64_t l = q.size(2) / chunks;
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const auto qf = grouped(q.to(at::kFloat), kv_heads);
  const auto dout = grouped(grad_out.to(at::kFloat), kv_heads);
  // D_i = rowsum(dO_i * O_i): the softmax's backward, per query.
  const auto delta = (dout * grouped(out.to(at::kFloat), kv_heads)).sum(-1);
  auto dq = at::zeros_like(qf);
  const auto mine = detail::chunks_of(ring.rank, ring.ranks, ring.sharding);
  at::Tensor kv = at::stack({k, v}).to(at::kFloat).contiguous(), next;
  // The gradients of the k and v held: they travel one hop behind them.
  at::Tensor dkv = at::zeros_like(kv), dkv_next;
  std::vector<WorkPtr> inflight, gradients;
  for (int64_t step = 0; step < ring.ranks; ++step) {
    if (step + 1 < ring.ranks) {
      next = at::empty_like(kv);
      inflight = ring.hop(kv, next);
    }
    const auto theirs = detail::chunks_of(ring.source(step), ring.ranks, ring.sharding);
    for (size_t i = 0; i < mine.size(); ++i) {
      const auto rows = [&](const at::Tensor& t) { return t.narrow(3, static_cast<int64_t>(i) * l, l); };
      const auto qi = rows(qf), doi = rows(dout);
      for (size_t j = 0; j < theirs.size(); ++j) {
        const int how = ring.meeting(mine[i], theirs[j]);
        if (how == 0) continue;
        const auto cols = [&](const at::Tensor& t) { return t.narrow(2, static_cast<int64_t>(j) * l, l); };
        const auto kj = cols(kv[0]).unsqueeze(2), vj = cols(kv[1]).unsqueeze(2);
        const auto p = (scores(qi, kj, scale, how == 2) - rows(lse).unsqueeze(-1)).exp();
        const auto ds = p * (at::matmul(doi, vj.transpose(-2, -1)) - rows(delta).unsqueeze(-1));
        rows(dq).add_(at::matmul(ds, kj), scale);
        cols(dkv[0]).add_(at::matmul(ds.transpose(-2, -1), qi).sum(2), scale);
        cols(dkv[1]).add_(at::matmul(p.transpose(-2, -1), doi).sum(2));
      }
    }
    // These gradients go on to the next rank, which holds these k and v
    // next; the last hop brings every rank its own.
    if (ring.ranks > 1) {
      dkv_next = at::empty_like(dkv);
      gradients = ring.hop(dkv, dkv_next);
      wait_all(gradients);
      dkv = dkv_next;
    }
    if (step + 1 < ring.ranks) {
      wait_all(inflight);
      kv = next;
    }
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
