#pragma once

// Argument checks shared by every collective. Each failure is an
// InvalidArgument naming the operation, the argument and what was wrong,
// raised before anything is sent.

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "dtrain/process_group.h"

namespace dtrain {

class TensorChecks {
 public:
  TensorChecks(const char* op, const ProcessGroup& group) : op_(op), group_(group) {}

  // Defined, dense, of a supported dtype, on a device the backend handles.
  void tensor(const char* what, const at::Tensor& t) const;
  void root(int root) const;
  // A peer rank: in range and not this rank.
  void peer(const char* what, int peer) const;
  // `n` tensors, each with the dtype, device and number of elements of `like`.
  void list_like(const char* what, const std::vector<at::Tensor>& list, const at::Tensor& like,
                 int n) const;
  // A list that only the root passes.
  void empty_list(const char* what, const std::vector<at::Tensor>& list, int root) const;
  // `n` valid tensors of one dtype (sizes may differ).
  void list_same_dtype(const char* what, const std::vector<at::Tensor>& list, int n) const;
  void same_dtype(const char* what_a, const at::Tensor& a, const char* what_b,
                  const at::Tensor& b) const;
  // `flat` holds `n` tensors like `piece` (same dtype and device):
  // concatenated along dim 0 ([n * d0, d1, ...]) or stacked ([n, d0, ...]).
  void flat_of(const char* what_flat, const at::Tensor& flat, const char* what_piece,
               const at::Tensor& piece, int n) const;

  // `op` can reduce `t`'s dtype (the bitwise ops only integers).
  void reduce_op(ReduceOp op, const at::Tensor& t) const;

  static bool dtype_supported(at::ScalarType type);

 private:
  const char* op_;
  const ProcessGroup& group_;
};

}  // namespace dtrain
