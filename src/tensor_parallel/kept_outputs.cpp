// Selective activation checkpointing's kept outputs (kept_outputs.h) and
// dtrain::linear (activation_checkpoint.h).

#include "tensor_parallel/kept_outputs.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/version.h>

#include <algorithm>
#include <string>
#include <utility>

#include "common/enforce.h"

namespace dtrain {
namespace detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

thread_local KeptOutputs* current = nullptr;

// The kept output travels into the node's forward in this, so that
// autograd does not take it for an input (its output would then be a view
// of one).
struct Kept {
  at::Tensor out;
};

// autograd's mm_mat1_backward and mm_mat2_backward (FunctionsManual.cpp) for
// strided tensors and alpha 1, call for call: the same products in the
// same orientation, so the same bits.
at::Tensor mat1_gradient(const at::Tensor& grad, const at::Tensor& mat2, at::IntArrayRef sizes,
                         at::IntArrayRef strides) {
  if (strides[0] == 1 && strides[1] == sizes[0]) return mat2.conj().mm(grad.t()).t();
  return grad.mm(mat2.t().conj());
}

at::Tensor mat2_gradient(const at::Tensor& grad, const at::Tensor& mat1, at::IntArrayRef sizes,
                         at::IntArrayRef strides) {
  if (strides[0] == 1 && strides[1] == sizes[0]) return grad.t().mm(mat1.conj()).t();
  return mat1.t().conj().mm(grad);
}

// As AddmmBackward0 and MmBackward0 do: mat1 only for mat2's gradient,
// mat2 only for mat1's; both shapes and strides (the gradient's
// orientation depends on them).
void save_matrices(AutogradContext* ctx, const at::Tensor& mat1, const at::Tensor& mat2) {
  ctx->save_for_backward({mat2.requires_grad() ? mat1 : at::Tensor(), mat1.requires_grad() ? mat2 : at::Tensor()});
  ctx->saved_data["mat1_sizes"] = mat1.sizes().vec();
  ctx->saved_data["mat1_strides"] = mat1.strides().vec();
  ctx->saved_data["mat2_sizes"] = mat2.sizes().vec();
  ctx->saved_data["mat2_strides"] = mat2.strides().vec();
}

// The gradients AddmmBackward0 and MmBackward0 give mat1 and mat2 for the
// output's `grad`, those a node does not need undefined.
std::pair<at::Tensor, at::Tensor> matmul_gradients(AutogradContext* ctx, const at::Tensor& grad,
                                                   size_t mat1_input) {
  const auto saved = ctx->get_saved_variables();
  auto ints = [&](const char* key) { return ctx->saved_data[key].toIntVector(); };
  at::Tensor mat1_grad, mat2_grad;
  if (ctx->needs_input_grad(mat1_input))
    mat1_grad = mat1_gradient(grad, saved[1], ints("mat1_sizes"), ints("mat1_strides"));
  if (ctx->needs_input_grad(mat1_input + 1))
    mat2_grad = mat2_gradient(grad, saved[0], ints("mat2_sizes"), ints("mat2_strides"));
  return {mat1_grad, mat2_grad};
}

// mm(mat1, mat2) whose result was kept: returns it; the backward is
// MmBackward0's.
struct KeptMm : torch::autograd::Function<KeptMm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& mat1, const at::Tensor& mat2,
                            const Kept& kept) {
    save_matrices(ctx, mat1, mat2);
    return kept.out;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto [mat1_grad, mat2_grad] = matmul_gradients(ctx, grads[0], 0);
    return {mat1_grad, mat2_grad, at::Tensor()};
  }
};

// addmm(bias, mat1, mat2), likewise, as AddmmBackward0: the bias's
// gradient is the output's, summed to the bias's shape by the engine (as
// for addmm).
struct KeptAddmm : torch::autograd::Function<KeptAddmm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor&, const at::Tensor& mat1,
                            const at::Tensor& mat2, const Kept& kept) {
    save_matrices(ctx, mat1, mat2);
    return kept.out;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto [mat1_grad, mat2_grad] = matmul_gradients(ctx, grads[0], 1);
    return {ctx->needs_input_grad(0) ? grads[0] : at::Tensor(), mat1_grad, mat2_grad, at::Tensor()};
  }
};

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool autocast_on(c10::DeviceType type) { return at::autocast::is_autocast_enabled(type); }
at::ScalarType autocast_dtype(c10::DeviceType type) { return at::autocast::get_autocast_dtype(type); }
#else
bool autocast_on(c10::DeviceType type) {
  return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
at::ScalarType autocast_dtype(c10::DeviceType type) {
  return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                      : at::autocast::get_autocast_gpu_dtype();
}
#endif

// What autocast does to addmm's and mm's arguments before the multiply it
// is handing back ran: the same casts (cached alike), so that the node
// saves what that multiply's node saved.
at::Tensor as_autocast_would(const at::Tensor& t) {
  if (!t.defined()) return t;
  const auto type = t.device().type();
  if (type != c10::DeviceType::CPU && type != c10::DeviceType::CUDA) return t;
  if (!autocast_on(type)) return t;
  return at::autocast::cached_cast(autocast_dtype(type), t, type);
}

}  // namespace

KeptOutputsScope::KeptOutputsScope(KeptOutputs* kept, bool recomputing) : outer_(current) {
  current = kept;
  if (!kept) return;
  kept->recomputing = recomputing;
  if (recomputing) kept->next = 0;  // from the start, even after a recomputation that threw
}

KeptOutputsScope::~KeptOutputsScope() { current = outer_; }

void finish_recomputation(KeptOutputs& kept) {
  const size_t ran = kept.next;
  kept.next = 0;
  DTRAIN_CHECK_ARG(ran == kept.entries.size(), "activation_checkpoint: the segment ran ", ran,
                   ran == 1 ? " matrix multiply" : " matrix multiplies", " when recomputed but ",
                   kept.entries.size(), " in the forward; it must compute the same thing twice");
}

void forget_aliases_of(KeptOutputs& kept, const at::Tensor& segment_output) {
  for (auto& entry : kept.entries)
    if (entry.out.defined() && entry.out.is_alias_of(segment_output)) entry.out = at::Tensor();
}

MatmulSite::MatmulSite(const char* kind) : kept_(current) {
  if (!kept_) return;
  if (!kept_->recomputing) {
    index_ = kept_->entries.size();
    kept_->entries.push_back({kind, at::Tensor(), 0});
    return;
  }
  index_ = kept_->next++;
  DTRAIN_CHECK_ARG(index_ < kept_->entries.size(), "activation_checkpoint: the segment ran more ",
                   "matrix multiplies when recomputed than the ", kept_->entries.size(),
                   " of its forward (", kind, " was one too many); it must compute the same thing twice");
  const char* then = kept_->entries[index_].kind;
  DTRAIN_CHECK_ARG(std::string(then) == kind, "activation_checkpoint: the segment's matrix multiply #",
                   index_, " was a ", then, " in the forward but a ", kind,
                   " when recomputed; it must compute the same thing twice");
}

at::Tensor MatmulSite::take_kept(at::IntArrayRef sizes) {
  if (!kept_ || !kept_->recomputing) return {};
  auto& entry = kept_->entries[index_];
  if (!entry.out.defined()) return {};
  at::Tensor out = std::move(entry.out);
  entry.out = at::Tensor();
  DTRAIN_CHECK_ARG(out.sizes() == sizes, "activation_checkpoint: the ", entry.kind, " (matrix multiply #",
                   index_, " of the segment) kept an output of shape ", out.sizes(),
                   " in the forward but makes one of shape ", sizes,
                   " when recomputed; it must compute the same thing twice");
  DTRAIN_CHECK_ARG(out._version() == entry.version, "activation_checkpoint: the output of the ",
                   entry.kind, " (matrix multiply #", index_,
                   " of the segment) that the policy kept was changed in place after it was kept; ",
                   "make that operation out of place, or leave this multiply out of the policy");
  return out;
}

void MatmulSite::offer(const at::Tensor& out) {
  if (!kept_ || kept_->recomputing) return;
  auto& entry = kept_->entries[index_];
  if (!kept_->policy({entry.kind, static_cast<int64_t>(index_)})) return;
  // Detached: the same storage and version counter, but none of the
  // autograd history that the recomputation's node will give it.
  entry.out = out.detach();
  entry.version = out._version();
}

namespace {

at::Tensor folded(const at::Tensor& x, const at::Tensor& w) {
  DTRAIN_CHECK_ARG(w.dim() == 2, "linear: a weight of shape ", w.sizes(), " (it must be 2-D: [out, in])");
  DTRAIN_CHECK_ARG(x.dim() >= 1, "linear: an input of no dimensions (it needs a last one of ", w.size(1),
                   " features)");
  DTRAIN_CHECK_ARG(x.size(-1) == w.size(1), "linear: an input of shape ", x.sizes(), " for a weight of shape ",
                   w.sizes(), " (the input's last dimension must be the weight's second)");
  return x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
}

// The weight as the multiply takes it: transposed, after autocast's cast
// of the weight itself (a parameter, so cached for the autocast region;
// its transpose, a view, would be cast again at every call).
at::Tensor transposed(const at::Tensor& w) { return as_autocast_would(w).t(); }

at::Tensor unfolded(const at::Tensor& out, const at::Tensor& x) {
  if (x.dim() == 2) return out;
  auto sizes = x.sizes().vec();
  sizes.back() = out.size(1);
  return out.view(sizes);
}

at::Tensor kept_matmul(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b, at::Tensor kept) {
  if (!b.defined()) return KeptMm::apply(as_autocast_would(x2), transposed(w), Kept{std::move(kept)});
  return KeptAddmm::apply(as_autocast_would(b), as_autocast_would(x2), transposed(w), Kept{std::move(kept)});
}

}  // namespace

at::Tensor folded_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const auto x2 = folded(x, w);
  return unfolded(b.defined() ? at::addmm(b, x2, transposed(w)) : at::mm(x2, transposed(w)), x);
}

at::Tensor checkpointed_linear(const char* kind, const at::Tensor& x, const at::Tensor& w,
                               const at::Tensor& b) {
  const auto x2 = folded(x, w);
  MatmulSite site(kind);
  at::Tensor out = site.take_kept({x2.size(0), w.size(0)});
  if (out.defined()) return unfolded(kept_matmul(x2, w, b, std::move(out)), x);
  out = b.defined() ? at::addmm(b, x2, transposed(w)) : at::mm(x2, transposed(w));
  site.offer(out);
  return unfolded(out, x);
}

at::Tensor linear_never_read(const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype) {
  const auto x2 = folded(x, w);
  auto stand_in = at::zeros({}, x2.options().dtype(dtype)).expand({x2.size(0), w.size(0)});
  return unfolded(kept_matmul(x2, w, at::Tensor(), std::move(stand_in)), x);
}

}  // namespace detail

CheckpointPolicy keep_matmul_outputs() {
  return [](const CheckpointedOp&) { return true; };
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  return detail::checkpointed_linear("linear", input, weight, bias);
}

}  // namespace dtrain
