// PowerSGD gradient compression (Vogels, Karimireddy, Jaggi: "PowerSGD:
// Practical Low-Rank Gradient Compression for Distributed Optimization",
// NeurIPS 2019), as a DDP comm hook.
//
// Per bucket and iteration, after the warm-up:
//   1. M_i = grad_i (+ error_i from last time) for every gradient that is a
//      matrix worth compressing (n*m > rate * r*(n+m)); the others are
//      all-reduced as they are, in one flat tensor.
//   2. P_i = M_i Q_i for all i, all-reduced together, each P_i orthogonalized
//      (Gram-Schmidt on its r columns).
//   3. Q_i = M_i^T P_i, all-reduced together.
//   4. grad_i = P_i Q_i^T / divisor; error_i = M_i - P_i Q_i^T / (ranks' share)
// All ranks start from the same random Q (a seeded generator), and with
// warm_start reuse last iteration's Q, which makes one power iteration per
// step enough.

#include <ATen/ATen.h>

#include <map>
#include <mutex>

#include "common/enforce.h"
#include "dtrain/ddp/comm_hooks.h"

namespace dtrain {
namespace {

struct BucketState {
  std::vector<at::Tensor> q;       // per compressed matrix, m x r
  std::vector<at::Tensor> error;   // per compressed matrix, n x m
};

struct State {
  PowerSGDOptions options;
  std::mutex mutex;
  std::map<int, BucketState> buckets;
};

// In place: orthonormal columns (modified Gram-Schmidt).
void orthogonalize(at::Tensor& p) {
  const auto r = p.size(1);
  for (int64_t k = 0; k < r; ++k) {
    auto col = p.select(1, k);
    col.div_(col.norm().clamp_min(1e-8));
    if (k + 1 < r) {
      auto rest = p.narrow(1, k + 1, r - k - 1);
      rest.sub_(at::outer(col, at::matmul(col, rest)));
    }
  }
}

bool worth_compressing(const at::Tensor& g, int rank, double rate) {
  if (g.dim() < 2) return false;
  const double n = static_cast<double>(g.size(0));
  const double m = static_cast<double>(g.numel()) / n;
  return n * m >= rate * rank * (n + m);
}

at::Tensor as_matrix(const at::Tensor& g) { return g.reshape({g.size(0), -1}); }

void powersgd_bucket(State& s, ProcessGroup& group, GradBucket& bucket) {
  const auto& o = s.options;
  if (bucket.iteration < o.start_powersgd_iter()) {
    allreduce_hook()(group, bucket);
    return;
  }
  std::lock_guard<std::mutex> lock(s.mutex);
  auto& st = s.buckets[bucket.index];
  std::vector<at::Tensor> matrices, plain;
  for (auto& g : bucket.gradients) {
    if (worth_compressing(g, o.matrix_approximation_rank(), o.min_compression_rate())) {
      matrices.push_back(g);
    } else {
      plain.push_back(g);
    }
  }
  // Uncompressed part: one flat all_reduce.
  if (!plain.empty()) {
    std::vector<at::Tensor> flat;
    for (auto& g : plain) flat.push_back(g.reshape({-1}));
    auto packed = at::cat(flat).div_(bucket.divisor);
    group.all_reduce(packed, ReduceOp::SUM)->wait();
    int64_t off = 0;
    for (auto& g : plain) {
      g.view({-1}).copy_(packed.narrow(0, off, g.numel()));
      off += g.numel();
    }
  }
  if (matrices.empty()) return;

  const int64_t r = o.matrix_approximation_rank();
  const bool fresh = st.q.size() != matrices.size();
  if (fresh) {
    st.q.clear();
    st.error.clear();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed() + 1000003ULL * bucket.index);
    for (auto& g : matrices) {
      auto m = as_matrix(g);
      st.q.push_back(at::randn({m.size(1), r}, gen, m.options().dtype(at::kFloat)).to(m.dtype()));
      st.error.push_back(at::zeros_like(m));
    }
  } else if (!o.warm_start()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed() + 7919ULL * bucket.iteration);
    for (auto& q : st.q) q.copy_(at::randn(q.sizes(), gen, q.options().dtype(at::kFloat)));
  }

  std::vector<at::Tensor> ms, ps;
  for (size_t i = 0; i < matrices.size(); ++i) {
    auto m = as_matrix(matrices[i]).clone();
    if (o.use_error_feedback()) m.add_(st.error[i]);
    ms.push_back(m);
    ps.push_back(at::matmul(m, st.q[i]));
  }
  auto pack = [](const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> flat;
    for (auto& t : ts) flat.push_back(t.reshape({-1}));
    return at::cat(flat);
  };
  auto unpack = [](const at::Tensor& packed, std::vector<at::Tensor>& ts) {
    int64_t off = 0;
    for (auto& t : ts) {
      t.view({-1}).copy_(packed.narrow(0, off, t.numel()));
      off += t.numel();
    }
  };
  auto p_all = pack(ps);
  group.all_reduce(p_all, ReduceOp::SUM)->wait();
  unpack(p_all, ps);
  for (auto& p : ps) orthogonalize(p);
  for (size_t i = 0; i < matrices.size(); ++i) st.q[i] = at::matmul(ms[i].t(), ps[i]).contiguous();
  auto q_all = pack(st.q);
  group.all_reduce(q_all, ReduceOp::SUM)->wait();
  unpack(q_all, st.q);
  for (size_t i = 0; i < matrices.size(); ++i) {
    // Sum over ranks of M ≈ P Q^T (Q carries the sum); average it.
    auto approx_sum = at::matmul(ps[i], st.q[i].t());
    auto avg = approx_sum / bucket.divisor;
    if (o.use_error_feedback()) st.error[i] = ms[i] - approx_sum / group.size();
    matrices[i].copy_(avg.view(matrices[i].sizes()));
  }
}

}  // namespace

CommHook powersgd_hook(const PowerSGDOptions& options) {
  DTRAIN_CHECK_ARG(options.matrix_approximation_rank() >= 1,
                   "PowerSGD: matrix_approximation_rank must be >= 1, got ",
                   options.matrix_approximation_rank());
  DTRAIN_CHECK_ARG(options.start_powersgd_iter() >= 0,
                   "PowerSGD: start_powersgd_iter must be >= 0, got ", options.start_powersgd_iter());
  auto state = std::make_shared<State>();
  state->options = options;
  return [state](ProcessGroup& group, GradBucket& bucket) { powersgd_bucket(*state, group, bucket); };
}

}  // namespace dtrain
