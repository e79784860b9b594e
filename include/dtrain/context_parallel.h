#pragma once

// Context parallelism: a sequence too long for one rank's attention split
// over the ranks of a group (c ranks), each holding a part of it.
//
// Sharding (how the sequence is split): kHeadTail (the default) cuts it
// into 2c chunks and gives rank r chunks r and 2c - 1 - r, one early and
// one late, so that under a causal mask every rank has the same work
// (torchtitan's head-tail load balancer); kContiguous gives rank r the r-th
// of c slices, where under a causal mask the last rank works about
// 2c - 1 times as much as the first. shard_sequence cuts a whole sequence,
// sequence_positions says which positions a rank holds (for rotary
// embeddings), unshard_sequence puts the parts back together.
//
// ring_attention (arXiv 2310.01889; torchtitan's and Megatron's context
// parallelism) keeps q on its rank and passes k and v around the ring of
// ranks: each rank attends its q to one rank's k and v per step with an
// online softmax (output and log-sum-exp merged block by block), while the
// next block is in flight. Blocks that the causal mask hides entirely are
// skipped. The backward passes k and v around again, with their gradients
// travelling along and arriving home after the last step. A rank sends and
// receives all of k and v once (c - 1 hops of its share), and holds the
// scores of one block at a time.
//
// ulysses_attention is DeepSpeed Ulysses (arXiv 2309.14509; torchtitan and
// transformers call it the same): two all-to-alls turn the sequence parts
// of every head into whole sequences of 1/c of the heads, each rank runs
// plain attention over the whole sequence for its heads, and two more turn
// the result back into sequence parts of every head. Each rank sends and
// receives (c - 1)/c of its q, k, v and output, and holds the attention
// scores of 1/c of the heads.
//
//   // q: [batch, heads, seq / c, head_dim]; k, v: [batch, kv_heads, seq / c, head_dim]
//   auto q = dtrain::context_parallel::shard_sequence(q_whole, 2, cp_group);
//   ...
//   auto out = dtrain::context_parallel::ring_attention(q, k, v, cp_group);  // causal
//   // out: [batch, heads, seq / c, head_dim], this rank's positions
//
// Gradients flow to q, k and v. Grouped-query attention: kv_heads may be
// fewer than heads (heads a multiple of them). Ulysses needs whole heads
// per rank: c divides heads, and kv_heads divides c or c divides kv_heads
// (each kv head is repeated for the ranks that need it). Refused by name:
// a sequence the sharding does not divide, heads as above, shapes that
// differ.

#include <ATen/core/Tensor.h>

#include <memory>

#include "dtrain/process_group.h"

namespace dtrain::context_parallel {

enum class Sharding { kHeadTail, kContiguous };

// This rank's part of `whole` (every rank's the same sequence) along
// dimension `dim`: its chunks under `sharding`, in order. Differentiable.
// `group` null: the default group.
at::Tensor shard_sequence(const at::Tensor& whole, int64_t dim,
                          const std::shared_ptr<ProcessGroup>& group = nullptr,
                          Sharding sharding = Sharding::kHeadTail);

// The positions in a sequence of `length` of the elements of this rank's
// part (int64, length / c of them, ascending within each chunk): what
// rotary embeddings of the part need.
at::Tensor sequence_positions(int64_t length, const std::shared_ptr<ProcessGroup>& group = nullptr,
                              Sharding sharding = Sharding::kHeadTail);

// The whole sequence from every rank's part along `dim` (an all-gather,
// then the chunks put in order). Collective over `group`; not
// differentiable (for outputs, references and evaluation).
at::Tensor unshard_sequence(const at::Tensor& part, int64_t dim,
                            const std::shared_ptr<ProcessGroup>& group = nullptr,
                            Sharding sharding = Sharding::kHeadTail);

// Attention over the whole sequence, softmax(q k^T / sqrt(head_dim)) v,
// causal by default, of this rank's parts (see above). Collective over
// `group` (null: the default group).
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::shared_ptr<ProcessGroup>& group = nullptr, bool causal = true,
                          Sharding sharding = Sharding::kHeadTail);

at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::shared_ptr<ProcessGroup>& group = nullptr, bool causal = true,
                             Sharding sharding = Sharding::kHeadTail);

// The same attention in one process (for references and tests; what each
// rank of Ulysses runs on its heads): q [B, H, S, D], k and v [B, Hkv, S, D].
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal = true);

}  // namespace dtrain::context_parallel
