#include "core/tensor_checks.h"

#include "common/enforce.h"

namespace dtrain {

bool TensorChecks::dtype_supported(at::ScalarType type) {
  switch (type) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kInt: case at::kLong: case at::kByte: case at::kChar:
      return true;
    default:
      return false;
  }
}

void TensorChecks::tensor(const char* what, const at::Tensor& t) const {
  DTRAIN_CHECK_ARG(t.defined(), op_, ": ", what, " is an undefined tensor");
  DTRAIN_CHECK_ARG(t.layout() == at::kStrided, op_, ": ", what, " is a ", t.layout(),
                   " tensor; only dense (strided) tensors are supported");
  DTRAIN_CHECK_ARG(dtype_supported(t.scalar_type()), op_, ": ", what, " has dtype ",
                   t.scalar_type(),
                   "; supported: Float, Double, Half, BFloat16, Int, Long, Byte, Char");
  DTRAIN_CHECK_ARG(group_.supports(t.device().type()), op_, ": ", what, " is on device ",
                   t.device(), " but backend '", group_.backend_name(),
                   "' does not handle that device type");
}

void TensorChecks::root(int root) const {
  DTRAIN_CHECK_ARG(root >= 0 && root < group_.size(), op_, ": root rank ", root,
                   " is out of range for group '", group_.name(), "' of size ", group_.size(),
                   " (expected 0..", group_.size() - 1, ")");
}

void TensorChecks::reduce_op(ReduceOp op, const at::Tensor& t) const {
  DTRAIN_CHECK_ARG(op != ReduceOp::PREMUL_SUM, op_, ": ReduceOp::PREMUL_SUM needs its factor: call ",
                   "dtrain::", op_, " with ReduceOptions().op(ReduceOp::PREMUL_SUM).premul_factor(f)");
  DTRAIN_CHECK_ARG(!is_bitwise(op) || at::isIntegralType(t.scalar_type(), /*includeBool=*/false),
                   op_, ": ReduceOp::", to_string(op), " is for integer tensors, got dtype ",
                   c10::toString(t.scalar_type()));
}

void TensorChecks::peer(const char* what, int peer) const {
  DTRAIN_CHECK_ARG(peer >= 0 && peer < group_.size(), op_, ": ", what, " rank ", peer,
                   " is out of range for group '", group_.name(), "' of size ", group_.size());
  DTRAIN_CHECK_ARG(peer != group_.rank(), op_, ": ", what, " rank ", peer,
                   " is this rank; a rank cannot ", op_, " to or from itself");
}

void TensorChecks::list_like(const char* what, const std::vector<at::Tensor>& list,
                             const at::Tensor& like, int n) const {
  DTRAIN_CHECK_ARG(static_cast<int>(list.size()) == n, op_, ": ", what, " has ", list.size(),
                   " tensors; expected ", n, " (one per rank of group '", group_.name(), "')");
  for (size_t i = 0; i < list.size(); ++i) {
    const auto name = detail::cat(what, "[", i, "]");
    tensor(name.c_str(), list[i]);
    DTRAIN_CHECK_ARG(list[i].scalar_type() == like.scalar_type(), op_, ": ", name,
                     " has dtype ", list[i].scalar_type(), " but expected ",
                     like.scalar_type());
    DTRAIN_CHECK_ARG(list[i].numel() == like.numel(), op_, ": ", name, " has ",
                     list[i].numel(), " elements (shape ", list[i].sizes(), ") but expected ",
                     like.numel(), " (shape ", like.sizes(), ")");
    DTRAIN_CHECK_ARG(list[i].device() == like.device(), op_, ": ", name, " is on ",
                     list[i].device(), " but expected ", like.device());
  }
}

void TensorChecks::empty_list(const char* what, const std::vector<at::Tensor>& list,
                              int root) const {
  DTRAIN_CHECK_ARG(list.empty(), op_, ": ", what, " must be empty on non-root rank ",
                   group_.rank(), " (root is ", root, "), got ", list.size(), " tensors");
}

void TensorChecks::list_same_dtype(const char* what, const std::vector<at::Tensor>& list,
                                   int n) const {
  DTRAIN_CHECK_ARG(static_cast<int>(list.size()) == n, op_, ": ", what, " has ", list.size(),
                   " tensors; expected ", n, " (one per rank of group '", group_.name(), "')");
  for (size_t i = 0; i < list.size(); ++i) {
    const auto name = detail::cat(what, "[", i, "]");
    tensor(name.c_str(), list[i]);
    same_dtype(name.c_str(), list[i], detail::cat(what, "[0]").c_str(), list[0]);
  }
}

void TensorChecks::same_dtype(const char* what_a, const at::Tensor& a, const char* what_b,
                              const at::Tensor& b) const {
  DTRAIN_CHECK_ARG(a.scalar_type() == b.scalar_type(), op_, ": ", what_a, " has dtype ",
                   a.scalar_type(), " but ", what_b, " has ", b.scalar_type());
}

void TensorChecks::flat_of(const char* what_flat, const at::Tensor& flat, const char* what_piece,
                           const at::Tensor& piece, int n) const {
  same_dtype(what_flat, flat, what_piece, piece);
  DTRAIN_CHECK_ARG(flat.device() == piece.device(), op_, ": ", what_flat, " is on ",
                   flat.device(), " but ", what_piece, " is on ", piece.device());
  std::vector<int64_t> stacked{n};
  const auto dims = piece.sizes().vec();
  stacked.insert(stacked.end(), dims.begin(), dims.end());
  std::vector<int64_t> concatenated = dims;
  if (!concatenated.empty()) concatenated[0] *= n;
  const auto shape = flat.sizes().vec();
  const bool ok = shape == stacked || (!dims.empty() && shape == concatenated);
  DTRAIN_CHECK_ARG(ok, op_, ": ", what_flat, " has shape ", flat.sizes(), " for ", n,
                   " ranks' ", what_piece, " of shape ", piece.sizes(), "; expected ",
                   dims.empty() ? "" : detail::cat(at::IntArrayRef(concatenated),
                                                   " (concatenated) or "),
                   at::IntArrayRef(stacked), " (stacked)");
}

}  // namespace dtrain
