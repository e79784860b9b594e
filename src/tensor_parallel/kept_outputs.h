#pragma once

// Selective activation checkpointing's inside (activation_checkpoint.h):
// the matrix multiplies' outputs a segment keeps between its forward and
// its recomputation, found again by their order in the segment, and the
// autograd node that hands a kept output back with linear's gradients.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtrain/activation_checkpoint.h"

namespace dtrain::detail {

// One segment's: its policy, and per matrix multiply in the order the
// forward ran them, its kind and (when kept) its output.
struct KeptOutputs {
  struct Entry {
    const char* kind;
    at::Tensor out;       // undefined: not kept, or handed back already
    int64_t version = 0;  // out's version counter when kept
  };
  CheckpointPolicy policy;
  std::vector<Entry> entries;
  size_t next = 0;  // the recomputation's place in `entries`
  bool recomputing = false;
};

// Makes `kept` the segment whose matrix multiplies this thread counts until
// the scope ends (nullptr: none, as inside a segment without a policy).
class KeptOutputsScope {
 public:
  KeptOutputsScope(KeptOutputs* kept, bool recomputing);
  ~KeptOutputsScope();
  KeptOutputsScope(const KeptOutputsScope&) = delete;
  KeptOutputsScope& operator=(const KeptOutputsScope&) = delete;

 private:
  KeptOutputs* outer_;
};

// After a recomputation: it ran the forward's matrix multiplies, no fewer;
// its place goes back to the start (a retained graph's next backward
// recomputes the ones handed back already).
void finish_recomputation(KeptOutputs& kept);

// After the forward: outputs that are (or share storage with) the
// segment's own output are not kept but recomputed. The caller holds that
// output and may change it in place, which is allowed of a checkpoint's
// output; handed back, the change would show.
void forget_aliases_of(KeptOutputs& kept, const at::Tensor& segment_output);

// A matrix multiply of the current segment, given its place at
// construction (nothing outside a selective segment).
class MatmulSite {
 public:
  explicit MatmulSite(const char* kind);
  // In the recomputation, the output the forward kept here, handed over
  // (checked to have `sizes`); else undefined: compute it.
  at::Tensor take_kept(at::IntArrayRef sizes);
  // In the forward: `out` is this op's output, kept if the policy says so.
  void offer(const at::Tensor& out);

 private:
  KeptOutputs* kept_;
  size_t index_ = 0;
};

// linear(x, w, b) as dtrain computes it: x folded to 2-D, one addmm (mm
// without a bias), unfolded; no checkpoint sees it.
at::Tensor folded_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

// The same, as the current segment's matrix multiply of
// `kind`. In the recomputation with its output kept, no multiply runs: the
// output is the kept one, and the node behind it gives x, w and b
// autograd's addmm/mm gradients op for op, so bitwise those of the multiply
// run again.
at::Tensor checkpointed_linear(const char* kind, const at::Tensor& x, const at::Tensor& w,
                               const at::Tensor& b);

// linear(x, w) through the same node, for an output that no one reads: one
// whose consumer's output was kept (RowParallelLinear's collective). What
// it returns holds no memory (a zero of `dtype` expanded); the gradient it
// is given reaches x and w as linear's.
at::Tensor linear_never_read(const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype);

}  // namespace dtrain::detail
