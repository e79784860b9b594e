// Bucket assignment: caps, the small first bucket, kinds kept apart.

#include <gtest/gtest.h>

#include "ddp/bucket_assignment.h"

namespace dtrain::ddp {
namespace {

using Buckets = std::vector<std::vector<size_t>>;

TEST(BucketAssignment, FirstBucketUsesTheSmallCapThenTheLargeOne) {
  // Six 400-byte parameters, visited in reverse order; caps 500 then 1000.
  std::vector<ParamSlot> params(6, ParamSlot{400, 0});
  auto buckets = assign_buckets(params, reverse_order(6), 500, 1000);
  EXPECT_EQ(buckets, (Buckets{{5, 4}, {3, 2, 1}, {0}}));
}

TEST(BucketAssignment, KindsNeverShareABucket) {
  std::vector<ParamSlot> params{{100, 0}, {100, 1}, {100, 0}, {100, 1}};
  auto buckets = assign_buckets(params, {0, 1, 2, 3}, 1 << 20, 1 << 20);
  EXPECT_EQ(buckets, (Buckets{{0, 2}, {1, 3}}));
}

TEST(BucketAssignment, FollowsTheGivenOrder) {
  std::vector<ParamSlot> params(4, ParamSlot{600, 0});
  auto buckets = assign_buckets(params, {2, 0, 3, 1}, 500, 1000);
  EXPECT_EQ(buckets, (Buckets{{2}, {0, 3}, {1}}));
}

TEST(BucketAssignment, AParameterLargerThanTheCapGetsItsOwnBucket) {
  std::vector<ParamSlot> params{{10, 0}, {5000, 0}, {10, 0}};
  auto buckets = assign_buckets(params, {0, 1, 2}, 100, 100);
  EXPECT_EQ(buckets, (Buckets{{0, 1}, {2}}));
}

}  // namespace
}  // namespace dtrain::ddp
