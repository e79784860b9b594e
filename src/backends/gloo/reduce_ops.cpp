#include "backends/gloo/reduce_ops.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "common/enforce.h"

namespace dtrain::gloo_backend {
namespace {

// The arithmetic type each storage type is combined in.
template <typename T> struct Compute { using type = T; };
template <> struct Compute<c10::Half> { using type = float; };
template <> struct Compute<c10::BFloat16> { using type = float; };

struct Sum { template <typename C> static C apply(C a, C b) { return a + b; } };
struct Product { template <typename C> static C apply(C a, C b) { return a * b; } };
struct Min { template <typename C> static C apply(C a, C b) { return std::min(a, b); } };
struct Max { template <typename C> static C apply(C a, C b) { return std::max(a, b); } };

// Written as a plain loop over restrict-free pointers so the compiler
// vectorizes the common float/int cases.
template <typename T, typename Op>
void kernel(void* out, const void* a, const void* b, size_t n) {
  using C = typename Compute<T>::type;
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i)
    o[i] = static_cast<T>(Op::apply(static_cast<C>(x[i]), static_cast<C>(y[i])));
}

template <typename T>
ReduceFn for_type(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG: return &kernel<T, Sum>;
    case ReduceOp::PRODUCT: return &kernel<T, Product>;
    case ReduceOp::MIN: return &kernel<T, Min>;
    case ReduceOp::MAX: return &kernel<T, Max>;
  }
  return nullptr;
}

}  // namespace

ReduceFn reduce_function(c10::ScalarType dtype, ReduceOp op) {
  switch (dtype) {
    case c10::kFloat: return for_type<float>(op);
    case c10::kDouble: return for_type<double>(op);
    case c10::kHalf: return for_type<c10::Half>(op);
    case c10::kBFloat16: return for_type<c10::BFloat16>(op);
    case c10::kInt: return for_type<int32_t>(op);
    case c10::kLong: return for_type<int64_t>(op);
    case c10::kByte: return for_type<uint8_t>(op);
    case c10::kChar: return for_type<int8_t>(op);
    default: break;
  }
  throw InternalError(detail::cat("gloo: no reduction kernel for dtype ", dtype));
}

}  // namespace dtrain::gloo_backend
