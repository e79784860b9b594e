#pragma once

// Starting the ranks of a benchmark: child processes of dtrain-bench
// (`dtrain-bench rank MODE --flag value ...`) over env:// on 127.0.0.1, or
// on two network namespaces joined by a shaped link.

#include <string>
#include <vector>

#include "bench_util.h"

namespace at {
class Tensor;
}

namespace dtrain::bench {

// Two network namespaces joined by a veth pair whose both ends are shaped
// to RATE (tc tbf): ranks on "two hosts" behind a real-network-like link,
// where communication costs wire time rather than the CPU time of loopback
// TCP. Needs root. Removed on destruction.
class ShapedLink {
 public:
  // Ranks alternate between the hosts, or with `per_host` > 0 the first
  // per_host ranks are on the first host, the next on the second.
  explicit ShapedLink(const std::string& rate, int per_host = 0);
  ~ShapedLink();
  ShapedLink(const ShapedLink&) = delete;
  ShapedLink& operator=(const ShapedLink&) = delete;
  const std::string& ns(int rank) const { return ns_[per_host_ > 0 ? rank / per_host_ % 2 : rank % 2]; }
  // Bytes that have crossed the link so far, both directions (the first
  // host's veth counters).
  int64_t bytes() const;

 private:
  void cleanup();
  std::vector<std::string> ns_;
  std::string dev_;
  int per_host_ = 0;
};

// Starts `world` ranks of this binary (on `link`'s two hosts when given),
// with `env` ("NAME=value ...") added to their environment; returns rank
// 0's output.
std::string run_ranks(int world, const std::string& mode, const Args& a,
                      const ShapedLink* link = nullptr, const std::string& env = "");

// dtrain-bench ft (ft.cpp).
bool is_ft_mode(const std::string& mode);
int ft_rank_main(const std::string& mode, const Args& a);
int bench_ft(const Args& a);

// dtrain-bench cuda (cuda.cpp).
bool is_cuda_mode(const std::string& mode);
int cuda_rank_main(const std::string& mode, const Args& a);
int bench_cuda(const Args& a);

// dtrain-bench memory (memory.cpp).
bool is_memory_mode(const std::string& mode);
int memory_rank_main(const std::string& mode, const Args& a);
int bench_memory(const Args& a);

// dtrain-bench composed (composed.cpp).
bool is_composed_mode(const std::string& mode);
int composed_rank_main(const std::string& mode, const Args& a);
int bench_composed(const Args& a);

// dtrain-bench pipeline (pipeline.cpp).
bool is_pipeline_mode(const std::string& mode);
int pipeline_rank_main(const std::string& mode, const Args& a);
int bench_pipeline(const Args& a);

// dtrain-bench tp (tensor_parallel.cpp).
bool is_tp_mode(const std::string& mode);
int tp_rank_main(const std::string& mode, const Args& a);
int tp_reference_rank_main(const Args& a);  // tensor_parallel_ref.cpp
// Writes `t`'s values as raw float32 (what the *_vs_pytorch.py scripts read).
void write_float32(const std::string& path, const at::Tensor& t);  // tensor_parallel_ref.cpp
int moe_reference_rank_main(const Args& a);  // moe_ref.cpp
int cp_reference_rank_main(const Args& a);   // cp_ref.cpp

// dtrain-bench cp (context_parallel.cpp).
bool is_cp_mode(const std::string& mode);
int cp_rank_main(const std::string& mode, const Args& a);
int bench_cp(const Args& a);
int local_sgd_reference_rank_main(const Args& a);  // local_sgd_ref.cpp, bench/scripts/local_sgd_vs_pytorch.sh
int bench_tp(const Args& a);

// dtrain-bench ep (expert_parallel.cpp).
bool is_ep_mode(const std::string& mode);
int ep_rank_main(const std::string& mode, const Args& a);
int bench_ep(const Args& a);

// dtrain-bench slow-links (slow_links.cpp).
int slow_links_rank_main(const Args& a);
int bench_slow_links(const Args& a);

// dtrain-bench checkpoint (checkpoint.cpp).
bool is_checkpoint_mode(const std::string& mode);
int checkpoint_rank_main(const std::string& mode, const Args& a);
int bench_checkpoint(const Args& a);

}  // namespace dtrain::bench
