#include "algorithms/reduce_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/enforce.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DTRAIN_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DTRAIN_VECTOR_CLONES
#endif

namespace dtrain::kernels {
namespace {

// Integers are added and multiplied in an unsigned type of at least int's
// width, where overflow wraps by definition, and converted back (modulo
// 2^N: GCC's documented conversion, and the rule since C++20). Signed
// overflow, undefined in C++, never happens; the bits are PyTorch's.
template <typename T>
using Wrapping = decltype(std::make_unsigned_t<T>() + 0u);

struct Sum {
  template <typename T>
  T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>)
      return static_cast<T>(static_cast<Wrapping<T>>(a) + static_cast<Wrapping<T>>(b));
    else
      return static_cast<T>(a + b);
  }
};
struct Product {
  template <typename T>
  T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>)
      return static_cast<T>(static_cast<Wrapping<T>>(a) * static_cast<Wrapping<T>>(b));
    else
      return static_cast<T>(a * b);
  }
};
struct Min {
  template <typename T>
  T operator()(T a, T b) const { return b < a ? b : a; }
};
struct Max {
  template <typename T>
  T operator()(T a, T b) const { return a < b ? b : a; }
};

struct BitAnd {
  template <typename T>
  T operator()(T a, T b) const { return static_cast<T>(a & b); }
};
struct BitOr {
  template <typename T>
  T operator()(T a, T b) const { return static_cast<T>(a | b); }
};
struct BitXor {
  template <typename T>
  T operator()(T a, T b) const { return static_cast<T>(a ^ b); }
};

// Calls fn(functor) with the bitwise functor of `op` for integer T; other
// types were refused at the collective's entry (TensorChecks::reduce_op).
template <typename T, typename Fn>
void with_bitwise(ReduceOp op, Fn&& fn) {
  if constexpr (std::is_integral_v<T>) {
    if (op == ReduceOp::BAND) return fn(BitAnd{});
    if (op == ReduceOp::BOR) return fn(BitOr{});
    return fn(BitXor{});
  } else {
    throw InvalidArgument("the bitwise reductions (BAND, BOR, BXOR) are for integer tensors");
  }
}

template <typename T, typename F>
DTRAIN_VECTOR_CLONES void combine(T* __restrict out, const T* __restrict a,
                                  const T* __restrict b, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
}

// The same, storing the result twice (saves a pass over it). No pointer
// may overlap another: for out2 == a or b see combine_twice_in_place.
template <typename T, typename F>
DTRAIN_VECTOR_CLONES void combine_twice(T* __restrict out, T* __restrict out2,
                                        const T* __restrict a, const T* __restrict b, size_t n,
                                        F f) {
  for (size_t i = 0; i < n; ++i) out2[i] = out[i] = f(a[i], b[i]);
}

// out[i] = inout[i] = f(inout[i], other[i]) (kInPlaceFirst) or
// f(other[i], inout[i]): one source is also the second destination. It is
// read and written through inout alone, so `restrict` holds for every
// pointer (passing one buffer as both a restrict source and a restrict
// destination would be undefined). The operands stay in rank order.
template <bool kInPlaceFirst, typename T, typename F>
DTRAIN_VECTOR_CLONES void combine_twice_in_place(T* __restrict out, T* __restrict inout,
                                                 const T* __restrict other, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) {
    const T r = kInPlaceFirst ? f(inout[i], other[i]) : f(other[i], inout[i]);
    out[i] = r;
    inout[i] = r;
  }
}

template <typename T, typename F>
DTRAIN_VECTOR_CLONES void accumulate(T* __restrict acc, const T* __restrict b, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) acc[i] = f(acc[i], b[i]);
}

// The divisor stays an int: narrowed to T it would be wrong for the small
// integer types (128 is -128 as int8, 256 is 0 as uint8: a division by
// zero). int8/uint8 are promoted to int for the division, int64 divides as
// int64, and the quotient always fits T again.
template <typename T>
DTRAIN_VECTOR_CLONES void divide(T* __restrict acc, size_t n, int divisor) {
  // Integer division truncates toward zero, as torch's div(..., "trunc").
  for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] / divisor);
}

// float32/64 and integers: pairwise passes over the region, vectorized.
template <typename T, typename F>
void reduce_native(T* dst, T* dst2, const void* const* srcs, int nsrcs, size_t count, F f,
                   bool average, int divisor) {
  const T* first = static_cast<const T*>(srcs[0]);
  if (nsrcs == 1) {
    std::memcpy(dst, first, count * sizeof(T));
  } else if (nsrcs == 2 && dst2 && !(average && divisor != 1)) {
    const T* second = static_cast<const T*>(srcs[1]);
    if (dst2 == first)
      combine_twice_in_place<true>(dst, dst2, second, count, f);
    else if (dst2 == second)
      combine_twice_in_place<false>(dst, dst2, first, count, f);
    else
      combine_twice(dst, dst2, first, second, count, f);
    return;
  } else {
    combine(dst, first, static_cast<const T*>(srcs[1]), count, f);
    for (int k = 2; k < nsrcs; ++k) accumulate(dst, static_cast<const T*>(srcs[k]), count, f);
  }
  if (average && divisor != 1) divide(dst, count, divisor);
  if (dst2) std::memcpy(dst2, dst, count * sizeof(T));
}

// float16/bfloat16: accumulate in float32, round once.
template <typename T, typename F>
void reduce_widened(T* dst, const void* const* srcs, int nsrcs, size_t count, F f,
                    int divisor) {
  constexpr size_t kBlock = 256;
  float acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (size_t i = 0; i < n; ++i) acc[i] = static_cast<float>(s0[i]);
    for (int k = 1; k < nsrcs; ++k) {
      const T* s = static_cast<const T*>(srcs[k]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] = f(acc[i], static_cast<float>(s[i]));
    }
    if (divisor != 1)
      for (size_t i = 0; i < n; ++i) acc[i] /= static_cast<float>(divisor);
    for (size_t i = 0; i < n; ++i) dst[base + i] = static_cast<T>(acc[i]);
  }
}

template <typename T, typename F>
void reduce_typed(void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count, F f,
                  bool average, int divisor) {
  auto* out = static_cast<T*>(dst);
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    reduce_widened(out, srcs, nsrcs, count, f, average ? divisor : 1);
    if (dst2) std::memcpy(dst2, dst, count * sizeof(T));
  } else {
    reduce_native(out, static_cast<T*>(dst2), srcs, nsrcs, count, f, average, divisor);
  }
}

template <typename T>
void reduce_op(ReduceOp op, void* dst, void* dst2, const void* const* srcs, int nsrcs,
               size_t count, int divisor) {
  switch (op) {
    case ReduceOp::SUM: return reduce_typed<T>(dst, dst2, srcs, nsrcs, count, Sum{}, false, 1);
    case ReduceOp::AVG:
      return reduce_typed<T>(dst, dst2, srcs, nsrcs, count, Sum{}, true, divisor);
    case ReduceOp::PRODUCT:
      return reduce_typed<T>(dst, dst2, srcs, nsrcs, count, Product{}, false, 1);
    case ReduceOp::MIN: return reduce_typed<T>(dst, dst2, srcs, nsrcs, count, Min{}, false, 1);
    case ReduceOp::MAX: return reduce_typed<T>(dst, dst2, srcs, nsrcs, count, Max{}, false, 1);
    case ReduceOp::BAND:
    case ReduceOp::BOR:
    case ReduceOp::BXOR:
      return with_bitwise<T>(op, [&](auto f) {
        reduce_typed<T>(dst, dst2, srcs, nsrcs, count, f, false, 1);
      });
    case ReduceOp::PREMUL_SUM:
      break;  // turned into SUM before it reaches a backend
  }
  throw InternalError(detail::cat("unknown reduce op ", static_cast<int>(op)));
}

template <typename T, typename F>
void accumulate_typed(void* acc, const void* src, size_t count, F f) {
  auto* a = static_cast<T*>(acc);
  const auto* b = static_cast<const T*>(src);
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    for (size_t i = 0; i < count; ++i)
      a[i] = static_cast<T>(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
  } else {
    accumulate(a, b, count, f);
  }
}

template <typename T>
void accumulate_op(ReduceOp op, void* acc, const void* src, size_t count) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG: return accumulate_typed<T>(acc, src, count, Sum{});
    case ReduceOp::PRODUCT: return accumulate_typed<T>(acc, src, count, Product{});
    case ReduceOp::MIN: return accumulate_typed<T>(acc, src, count, Min{});
    case ReduceOp::MAX: return accumulate_typed<T>(acc, src, count, Max{});
    case ReduceOp::BAND:
    case ReduceOp::BOR:
    case ReduceOp::BXOR:
      return with_bitwise<T>(op, [&](auto f) { accumulate_typed<T>(acc, src, count, f); });
    case ReduceOp::PREMUL_SUM:
      break;  // turned into SUM before it reaches a backend
  }
  throw InternalError(detail::cat("unknown reduce op ", static_cast<int>(op)));
}

// Calls F<T>::run(args...) for the storage type T of dtype.
template <template <typename> class F, typename... Args>
void dispatch(c10::ScalarType dtype, Args&&... args) {
  switch (dtype) {
    case c10::ScalarType::Float: return F<float>::run(args...);
    case c10::ScalarType::Double: return F<double>::run(args...);
    case c10::ScalarType::Half: return F<c10::Half>::run(args...);
    case c10::ScalarType::BFloat16: return F<c10::BFloat16>::run(args...);
    case c10::ScalarType::Int: return F<int32_t>::run(args...);
    case c10::ScalarType::Long: return F<int64_t>::run(args...);
    case c10::ScalarType::Byte: return F<uint8_t>::run(args...);
    case c10::ScalarType::Char: return F<int8_t>::run(args...);
    default:
      throw InvalidArgument(
          detail::cat("reductions of dtype ", c10::toString(dtype), " are not supported"));
  }
}

template <typename T>
struct ReduceInto {
  static void run(ReduceOp op, void* dst, void* dst2, const void* const* srcs, int nsrcs,
                  size_t count, int divisor) {
    reduce_op<T>(op, dst, dst2, srcs, nsrcs, count, divisor);
  }
};

template <typename T>
struct AccumulateInto {
  static void run(ReduceOp op, void* acc, const void* src, size_t count) {
    accumulate_op<T>(op, acc, src, count);
  }
};

template <typename T>
struct DivideBy {
  static void run(void* data, size_t count, int divisor) {
    auto* d = static_cast<T*>(data);
    if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
      for (size_t i = 0; i < count; ++i)
        d[i] = static_cast<T>(static_cast<float>(d[i]) / static_cast<float>(divisor));
    } else {
      divide(d, count, divisor);
    }
  }
};

}  // namespace

void divide_by(c10::ScalarType dtype, void* data, size_t count, int divisor) {
  if (count == 0 || divisor == 1) return;
  dispatch<DivideBy>(dtype, data, count, divisor);
}

bool can_reduce(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: case c10::ScalarType::Double: case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16: case c10::ScalarType::Int: case c10::ScalarType::Long:
    case c10::ScalarType::Byte: case c10::ScalarType::Char:
      return true;
    default:
      return false;
  }
}

void accumulate_into(c10::ScalarType dtype, ReduceOp op, void* acc, const void* src,
                     size_t count) {
  if (count == 0) return;
  dispatch<AccumulateInto>(dtype, op, acc, src, count);
}

void reduce_into(c10::ScalarType dtype, ReduceOp op, void* dst, void* dst2,
                 const void* const* srcs, int nsrcs, size_t count, int divisor) {
  DTRAIN_ENFORCE(nsrcs >= 1);
  if (count == 0) return;
  dispatch<ReduceInto>(dtype, op, dst, dst2, srcs, nsrcs, count, divisor);
}

}  // namespace dtrain::kernels
