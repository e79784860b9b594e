#pragma once

// Context parallelism: a sequence too long for one rank's attention split
// over the ranks of a group, each holding a contiguous shard of it.
//
// ulysses_attention is DeepSpeed Ulysses (arXiv 2309.14509; torchtitan and
// transformers call it the same): two all-to-alls turn the sequence shards
// of every head into whole sequences of 1/c of the heads, each rank runs
// plain attention over the whole sequence for its heads, and two more turn
// the result back into sequence shards of every head. Each rank sends and
// receives (c - 1)/c of its q, k, v and output: a volume independent of
// the sequence's length per rank's share, and attention's memory per rank
// 1/c of one process's.
//
//   // q: [batch, heads, seq / c, head_dim]; k, v: [batch, kv_heads, seq / c, head_dim]
//   auto out = dtrain::context_parallel::ulysses_attention(q, k, v, cp_group);  // causal
//   // out: [batch, heads, seq / c, head_dim], this rank's positions
//
// Rank r holds positions [r seq/c, (r + 1) seq/c) (contiguous shards; the
// causal mask follows them). Gradients flow to q, k and v through the
// all-to-alls (their backward is the inverse exchange). Grouped-query
// attention: kv_heads may be fewer than heads (heads a multiple of them);
// when c does not divide kv_heads, each kv head is repeated for the ranks
// that need it (c a multiple of kv_heads). Refused by name: heads that c
// does not divide, kv_heads that neither divides c nor is divided by it,
// shapes that differ. Ring attention is not built yet.

#include <ATen/core/Tensor.h>

#include <memory>

#include "dtrain/process_group.h"

namespace dtrain::context_parallel {

// Attention over the whole sequence, softmax(q k^T / sqrt(head_dim)) v,
// causal by default, of this rank's sequence shards (see above); `group`
// null: the default group. Collective over `group`.
at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::shared_ptr<ProcessGroup>& group = nullptr, bool causal = true);

// The same attention in one process (what each rank runs on its heads;
// for references and tests): q [B, H, S, D], k and v [B, Hkv, S, D].
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal = true);

}  // namespace dtrain::context_parallel
