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
// All ranks start from the same random Q (a generator seeded by the options'
// seed and the parameter's name), and with warm_start reuse last iteration's
// Q, which makes one power iteration per step enough. Q and error_i belong
// to the parameter, whichever bucket it is in (see MatrixState).

#include <ATen/ATen.h>

#include <map>
#include <mutex>

#include "common/enforce.h"
#include "dtrain/ddp/comm_hooks.h"

namespace dtrain {
namespace {

// Q and the error of one gradient matrix. Kept per parameter (by name), not
// per bucket: DDP rebuilds its buckets once, after the first iteration, in
// the order gradients became ready, and bucket i then holds other
// parameters; state kept per bucket index would be applied to the wrong
// gradients (or fail on their shapes) when PowerSGD starts before that.
// PyTorch keys it by bucket index and instead refuses start_powerSGD_iter
// <= 1 with error feedback or warm start (PowerSGDState raises ValueError);
// keyed by parameter, the state survives the rebuild whole, so any start
// works.
struct MatrixState {
  at::Tensor q;      // m x r
  at::Tensor error;  // n x m
};

struct State {
  PowerSGDOptions options;
  std::mutex mutex;
  std::map<std::string, MatrixState> matrices;
};

// Equal on every rank for the same name (std::hash need not be).
uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
  return h;
}

at::Tensor random_q(const at::Tensor& m, int64_t r, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({m.size(1), r}, gen, m.options().dtype(at::kFloat)).to(m.dtype());
}

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

// The gradients not worth compressing: one flat all_reduce.
void allreduce_plain(ProcessGroup& group, const GradBucket& bucket,
                     const std::vector<at::Tensor>& plain) {
  if (plain.empty()) return;
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

// The state of the matrix `m` of parameter `name`: new (random Q from a seed
// of the name, no error) the first time, or if the name now has another
// shape (a hook reused for another model).
MatrixState& state_for(State& s, const std::string& name, const at::Tensor& m, int64_t iteration) {
  const auto& o = s.options;
  const int64_t r = o.matrix_approximation_rank();
  const uint64_t seed = o.seed() + fnv1a(name);
  auto& st = s.matrices[name];
  if (!st.error.defined() || !st.error.sizes().equals(m.sizes()) ||
      st.error.scalar_type() != m.scalar_type()) {
    st.q = random_q(m, r, seed);
    st.error = at::zeros_like(m);
  } else if (!o.warm_start()) {
    st.q = random_q(m, r, seed + 7919ULL * static_cast<uint64_t>(iteration));
  }
  return st;
}

void powersgd_bucket(State& s, ProcessGroup& group, GradBucket& bucket) {
  const auto& o = s.options;
  if (bucket.iteration < o.start_powersgd_iter()) {
    allreduce_hook()(group, bucket);
    return;
  }
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<at::Tensor> matrices, plain;
  std::vector<MatrixState*> states;
  for (size_t i = 0; i < bucket.gradients.size(); ++i) {
    auto& g = bucket.gradients[i];
    if (!worth_compressing(g, o.matrix_approximation_rank(), o.min_compression_rate())) {
      plain.push_back(g);
      continue;
    }
    const auto name = i < bucket.parameter_names.size()
                          ? bucket.parameter_names[i]
                          : detail::cat("bucket ", bucket.index, " gradient ", i);
    matrices.push_back(g);
    states.push_back(&state_for(s, name, as_matrix(g), bucket.iteration));
  }
  allreduce_plain(group, bucket, plain);
  if (matrices.empty()) return;

  std::vector<at::Tensor> ms, ps, qs;
  for (size_t i = 0; i < matrices.size(); ++i) {
    auto m = as_matrix(matrices[i]).clone();
    if (o.use_error_feedback()) m.add_(states[i]->error);
    ms.push_back(m);
    ps.push_back(at::matmul(m, states[i]->q));
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
  for (size_t i = 0; i < matrices.size(); ++i) qs.push_back(at::matmul(ms[i].t(), ps[i]).contiguous());
  auto q_all = pack(qs);
  group.all_reduce(q_all, ReduceOp::SUM)->wait();
  unpack(q_all, qs);
  for (size_t i = 0; i < matrices.size(); ++i) {
    // Sum over ranks of M ≈ P Q^T (Q carries the sum); average it.
    auto approx_sum = at::matmul(ps[i], qs[i].t());
    auto avg = approx_sum / bucket.divisor;
    states[i]->q = qs[i];
    if (o.use_error_feedback()) states[i]->error = ms[i] - approx_sum / group.size();
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
