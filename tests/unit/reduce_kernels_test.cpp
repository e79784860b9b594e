// The reduction kernels, built into this test with UBSan (signed overflow
// and the like abort the test): integer SUM and PRODUCT wrap as in PyTorch,
// and the in-place path (the second destination is one of the sources, as
// the shm backend's all-reduce calls it) gives bitwise the out-of-place
// result.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "algorithms/reduce_kernels.h"
#include "core/average.h"

namespace dtrain::kernels {
namespace {

template <typename T>
c10::ScalarType dtype_of() {
  if constexpr (std::is_same_v<T, int8_t>) return c10::ScalarType::Char;
  if constexpr (std::is_same_v<T, uint8_t>) return c10::ScalarType::Byte;
  if constexpr (std::is_same_v<T, int32_t>) return c10::ScalarType::Int;
  if constexpr (std::is_same_v<T, int64_t>) return c10::ScalarType::Long;
  if constexpr (std::is_same_v<T, float>) return c10::ScalarType::Float;
  if constexpr (std::is_same_v<T, double>) return c10::ScalarType::Double;
  if constexpr (std::is_same_v<T, c10::Half>) return c10::ScalarType::Half;
  if constexpr (std::is_same_v<T, c10::BFloat16>) return c10::ScalarType::BFloat16;
  return c10::ScalarType::Undefined;
}

// Two's complement wrap-around, computed independently of the kernels: in
// uint64_t, then truncated to T's width.
template <typename T>
T wrapped(uint64_t bits) {
  T out;
  std::memcpy(&out, &bits, sizeof(T));  // little-endian: the low bytes
  return out;
}

template <typename T>
T wrapping_sum(const std::vector<T>& xs) {
  uint64_t acc = 0;
  for (T x : xs) acc += static_cast<uint64_t>(static_cast<int64_t>(x));
  return wrapped<T>(acc);
}

template <typename T>
T wrapping_product(const std::vector<T>& xs) {
  uint64_t acc = 1;
  for (T x : xs) acc *= static_cast<uint64_t>(static_cast<int64_t>(x));
  return wrapped<T>(acc);
}

// Per rank, values near T's limits (41 elements: vector lanes and a tail).
template <typename T>
std::vector<std::vector<T>> overflowing_inputs(int ranks) {
  using L = std::numeric_limits<T>;
  const std::vector<T> edge = {L::max(), L::min(), static_cast<T>(L::max() / 2 + 1),
                               static_cast<T>(-1), static_cast<T>(L::max() - 3),
                               static_cast<T>(L::min() + 5), static_cast<T>(3)};
  std::vector<std::vector<T>> in(ranks, std::vector<T>(41));
  for (int r = 0; r < ranks; ++r)
    for (size_t i = 0; i < 41; ++i) in[r][i] = edge[(i + 3 * r) % edge.size()];
  return in;
}

template <typename T>
void expect_integer_ops_wrap(int ranks) {
  const auto in = overflowing_inputs<T>(ranks);
  std::vector<const void*> srcs;
  for (const auto& v : in) srcs.push_back(v.data());
  const size_t n = in[0].size();
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::PRODUCT}) {
    std::vector<T> out(n), acc = in[0];
    reduce_into(dtype_of<T>(), op, out.data(), nullptr, srcs.data(), ranks, n, ranks);
    for (int r = 1; r < ranks; ++r) accumulate_into(dtype_of<T>(), op, acc.data(), srcs[r], n);
    for (size_t i = 0; i < n; ++i) {
      std::vector<T> column;
      for (const auto& v : in) column.push_back(v[i]);
      const T want = op == ReduceOp::SUM ? wrapping_sum(column) : wrapping_product(column);
      ASSERT_EQ(+out[i], +want) << "reduce_into " << (op == ReduceOp::SUM ? "SUM" : "PRODUCT")
                                << " of " << ranks << " element " << i;
      ASSERT_EQ(+acc[i], +want) << "accumulate_into " << (op == ReduceOp::SUM ? "SUM" : "PRODUCT")
                                << " of " << ranks << " element " << i;
    }
  }
}

TEST(ReduceKernels, SignedIntegerSumAndProductWrapLikePyTorch) {
  for (int ranks : {2, 3}) {
    expect_integer_ops_wrap<int32_t>(ranks);
    expect_integer_ops_wrap<int64_t>(ranks);
    expect_integer_ops_wrap<int8_t>(ranks);
  }
}

TEST(ReduceKernels, OverflowExamples) {
  const int32_t a[] = {std::numeric_limits<int32_t>::max(), 65536, -7};
  const int32_t b[] = {1, 65536, std::numeric_limits<int32_t>::min()};
  const void* srcs[] = {a, b};
  int32_t sum[3], product[3];
  reduce_into(c10::ScalarType::Int, ReduceOp::SUM, sum, nullptr, srcs, 2, 3, 2);
  reduce_into(c10::ScalarType::Int, ReduceOp::PRODUCT, product, nullptr, srcs, 2, 3, 2);
  EXPECT_EQ(sum[0], std::numeric_limits<int32_t>::min());
  EXPECT_EQ(sum[1], 131072);
  EXPECT_EQ(sum[2], 2147483641);                        // INT32_MIN - 7 wraps
  EXPECT_EQ(product[1], 0);                             // 2^32 wraps to 0
  EXPECT_EQ(product[2], std::numeric_limits<int32_t>::min());  // -7 * -2^31 = 2^31 * 7
  const int64_t big[] = {std::numeric_limits<int64_t>::max()};
  const void* twice[] = {big, big};
  int64_t s64 = 0;
  reduce_into(c10::ScalarType::Long, ReduceOp::SUM, &s64, nullptr, twice, 2, 1, 2);
  EXPECT_EQ(s64, -2);
}

// AVG divides the (wrapped) sum by the world size as an integer, truncating
// toward zero: the divisor is never narrowed to T, where 128 would be -128
// for int8 and 256 would be 0 for uint8 (a division by zero).
template <typename T>
void expect_integer_average_divides_by_the_world(int world) {
  const auto in = overflowing_inputs<T>(world);
  std::vector<const void*> srcs;
  for (const auto& v : in) srcs.push_back(v.data());
  const size_t n = in[0].size();
  std::vector<T> out(n);
  reduce_into(dtype_of<T>(), ReduceOp::AVG, out.data(), nullptr, srcs.data(), world, n, world);
  for (size_t i = 0; i < n; ++i) {
    std::vector<T> column;
    for (const auto& v : in) column.push_back(v[i]);
    const T want = static_cast<T>(static_cast<int64_t>(wrapping_sum(column)) / world);
    ASSERT_EQ(+out[i], +want) << "AVG of " << world << " " << c10::toString(dtype_of<T>())
                              << " element " << i << " (sum " << +wrapping_sum(column) << ")";
  }
}

TEST(ReduceKernels, IntegerAverageDividesByTheWorldSizeUnnarrowed) {
  for (int world : {127, 128, 200, 255, 256, 257, 1000}) {
    expect_integer_average_divides_by_the_world<int8_t>(world);
    expect_integer_average_divides_by_the_world<uint8_t>(world);
    expect_integer_average_divides_by_the_world<int32_t>(world);
    expect_integer_average_divides_by_the_world<int64_t>(world);
  }
}

// The backends that only sum (tcp, auto over hosts, mpi) divide afterwards
// with divide_for_average: the same rule.
TEST(ReduceKernels, DivideForAverageDividesByTheWorldSizeUnnarrowed) {
  const auto i8 = at::tensor({-128, -127, -1, 0, 1, 100, 127}, at::kChar);
  for (int world : {127, 128, 256, 1000}) {
    auto t = i8.clone();
    divide_for_average(t, world);
    EXPECT_TRUE(at::equal(t, i8.to(at::kLong).div(world, "trunc").to(at::kChar)))
        << "int8 / " << world << ": " << t;
  }
  const auto u8 = at::tensor({0, 1, 128, 255}, at::kByte);
  for (int world : {255, 256, 1000}) {
    auto t = u8.clone();
    divide_for_average(t, world);
    EXPECT_TRUE(at::equal(t, u8.to(at::kLong).div(world, "trunc").to(at::kByte)))
        << "uint8 / " << world << ": " << t;
  }
  auto f = at::tensor({1.0f, -3.0f}, at::kFloat);
  divide_for_average(f, 256);
  EXPECT_TRUE(at::equal(f, at::tensor({1.0f / 256, -3.0f / 256}, at::kFloat)));
}

// Bitwise comparison (NaN and -0.0 included).
template <typename T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
}

// Values whose MIN/MAX depend on the operand order (NaN, signed zeros).
template <typename T>
std::vector<T> order_sensitive(int rank, size_t n) {
  const float pool[] = {NAN, 0.0f, -0.0f, 1.5f, -2.0f, 3.0f, -0.0f, NAN, 7.0f};
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) {
    const float x = pool[(i * (rank + 2) + rank) % 9];
    if constexpr (std::is_integral_v<T>)
      v[i] = static_cast<T>(std::isnan(x) ? 100 - rank : static_cast<int>(x * 10) + rank);
    else
      v[i] = static_cast<T>(x);
  }
  return v;
}

template <typename T>
void expect_in_place_matches_out_of_place() {
  for (size_t n : {size_t{1}, size_t{7}, size_t{64}, size_t{1031}}) {
    for (ReduceOp op :
         {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT, ReduceOp::MIN, ReduceOp::MAX}) {
      const auto a = order_sensitive<T>(0, n), b = order_sensitive<T>(1, n);
      std::vector<T> want(n);
      const void* srcs[] = {a.data(), b.data()};
      reduce_into(dtype_of<T>(), op, want.data(), nullptr, srcs, 2, n, 1);
      for (int in_place : {0, 1}) {
        auto a2 = a, b2 = b;
        std::vector<T> out(n);
        T* inout = in_place == 0 ? a2.data() : b2.data();
        const void* aliased[] = {a2.data(), b2.data()};
        reduce_into(dtype_of<T>(), op, out.data(), inout, aliased, 2, n, 1);
        EXPECT_TRUE(same_bits(out, want)) << "dst, source " << in_place << " in place, n=" << n;
        EXPECT_TRUE(same_bits(in_place == 0 ? a2 : b2, want))
            << "dst2 (source " << in_place << "), n=" << n << " op " << static_cast<int>(op);
        EXPECT_TRUE(same_bits(in_place == 0 ? b2 : a2, in_place == 0 ? b : a))
            << "the other source changed, n=" << n;
      }
    }
  }
}

TEST(ReduceKernels, InPlaceSecondDestinationGivesTheOutOfPlaceBits) {
  expect_in_place_matches_out_of_place<float>();
  expect_in_place_matches_out_of_place<double>();
  expect_in_place_matches_out_of_place<c10::Half>();
  expect_in_place_matches_out_of_place<c10::BFloat16>();
  expect_in_place_matches_out_of_place<int32_t>();
  expect_in_place_matches_out_of_place<int64_t>();
  expect_in_place_matches_out_of_place<int8_t>();
  expect_in_place_matches_out_of_place<uint8_t>();
}

TEST(ReduceKernels, InPlaceKeepsRankOrderForMinAndMax) {
  // MIN(a, b) is b < a ? b : a: with a NaN or signed zeros the order shows.
  std::vector<float> a = {NAN, 1.0f, 0.0f, -0.0f}, b = {1.0f, NAN, -0.0f, 0.0f};
  const std::vector<float> want_min = {NAN, 1.0f, 0.0f, -0.0f};  // a wherever !(b < a)
  for (int in_place : {0, 1}) {
    auto a2 = a, b2 = b;
    std::vector<float> out(4);
    const void* srcs[] = {a2.data(), b2.data()};
    reduce_into(c10::ScalarType::Float, ReduceOp::MIN, out.data(),
                in_place == 0 ? a2.data() : b2.data(), srcs, 2, 4, 1);
    EXPECT_TRUE(same_bits(out, want_min)) << "source " << in_place << " in place";
    EXPECT_TRUE(same_bits(in_place == 0 ? a2 : b2, want_min)) << "source " << in_place;
  }
}

}  // namespace
}  // namespace dtrain::kernels
