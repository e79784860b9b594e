// Decimal numbers read from hostile text (src/common/decimal.h): what the
// lighthouse protocol, checkpoint metadata and healing parts parse counts
// with. A value past int64_t once threw std::out_of_range out of
// std::stoll, which the fuzzer found as a crash of the lighthouse protocol.

#include <gtest/gtest.h>

#include "common/decimal.h"

namespace dtrain::detail {
namespace {

TEST(DecimalText, ReadsEveryValueUpToInt64sLargest) {
  EXPECT_EQ(parse_decimal("0"), 0);
  EXPECT_EQ(parse_decimal("000"), 0);
  EXPECT_EQ(parse_decimal("42"), 42);
  EXPECT_EQ(parse_decimal("9223372036854775807"), INT64_MAX);
  EXPECT_EQ(parse_decimal("0009223372036854775"), 9223372036854775LL);
}

TEST(DecimalText, RefusesValuesPastInt64AndAnythingButDigits) {
  for (const char* bad : {"9223372036854775808", "9999999999999999912", "18446744073709551616",
                          "00000000000000000001", "", "-1", "+1", " 1", "1 ", "1e3", "0x10", "１"})
    EXPECT_FALSE(parse_decimal(bad).has_value()) << "'" << bad << "'";
}

TEST(DecimalText, Uint64ReadsUpToItsLargestAndRefusesPastIt) {
  EXPECT_EQ(parse_decimal_u64("0"), 0u);
  EXPECT_EQ(parse_decimal_u64("9223372036854775808"), 9223372036854775808ULL);
  EXPECT_EQ(parse_decimal_u64("18446744073709551615"), UINT64_MAX);
  for (const char* bad : {"18446744073709551616", "99999999999999999999", "000000000000000000001", "", "-1", "+1",
                          " 1", "1 ", "1e3", "0x10"})
    EXPECT_FALSE(parse_decimal_u64(bad).has_value()) << "'" << bad << "'";
}

}  // namespace
}  // namespace dtrain::detail
