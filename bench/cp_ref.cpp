// dtrain-bench rank context-ref: ring and Ulysses attention (context_parallel.h)
// at CP = the world's size, head-tail sharding, on the q, k, v and upstream
// gradient of bench/scripts/cp_vs_pytorch.py (a formula both compute), which
// runs F.scaled_dot_product_attention over the whole sequence in one
// process (run both with bench/scripts/cp_vs_pytorch.sh).
//
// Causal, grouped-query: batch 1, 4 q heads, 2 kv heads, head dim 16,
// sequence --seq (4096). Each rank writes, under --out/rank<r>/, float32
// values of its part (sequence dimension 2): <method>.out, <method>.dq,
// <method>.dk, <method>.dv for method ring and ulysses.

#include <torch/torch.h>

#include <string>
#include <sys/stat.h>

#include "dtrain/context_parallel.h"
#include "dtrain/dtrain.h"
#include "ranks.h"

namespace dtrain::bench {
namespace cp_ref {  // (named: dtrain-bench is a unity build)

namespace cp = context_parallel;
constexpr int64_t kHeads = 4, kKvHeads = 2, kHeadDim = 16;

// The formula cp_vs_pytorch.py repeats: sin(0.37 i + k) scaled, i the flat index.
at::Tensor formula(int64_t k, int64_t heads, int64_t seq) {
  const int64_t n = heads * seq * kHeadDim;
  return (torch::arange(n, torch::kDouble) * 0.37 + static_cast<double>(k)).sin().to(torch::kFloat).reshape(
      {1, heads, seq, kHeadDim});
}

int run(const Args& a) {
  init_process_group(InitOptions().backend(a.get("backend", "tcp")));
  torch::set_num_threads(1);
  auto g = default_group();
  const int64_t seq = a.num("seq", 4096);
  const std::string out = a.get("out", "context-ref"), dir = out + "/rank" + std::to_string(g->rank());
  for (const std::string& d : {out, dir}) mkdir(d.c_str(), 0755);
  const auto part = [&](const at::Tensor& whole) { return cp::shard_sequence(whole, 2, g); };
  const auto upstream = part(formula(3, kHeads, seq));
  for (const std::string method : {"ring", "ulysses"}) {
    auto q = part(formula(0, kHeads, seq)).requires_grad_(true);
    auto k = part(formula(1, kKvHeads, seq)).requires_grad_(true);
    auto v = part(formula(2, kKvHeads, seq)).requires_grad_(true);
    const auto o = method == "ring" ? cp::ring_attention(q, k, v, g) : cp::ulysses_attention(q, k, v, g);
    (o * upstream).sum().backward();
    write_float32(dir + "/" + method + ".out", o.detach());
    write_float32(dir + "/" + method + ".dq", q.grad());
    write_float32(dir + "/" + method + ".dk", k.grad());
    write_float32(dir + "/" + method + ".dv", v.grad());
  }
  destroy_process_group();
  return 0;
}

}  // namespace cp_ref

int cp_reference_rank_main(const Args& a) { return cp_ref::run(a); }

}  // namespace dtrain::bench
