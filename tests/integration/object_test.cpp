// Object collectives: byte strings and values of different sizes on every
// rank (including empty ones), exact, on tcp and shm at 1-4 ranks; sizes
// that are not a whole value are named.

#include <gtest/gtest.h>

#include <map>

#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using testing::RankContext;
using testing::run_rank_contexts;

// Rank r's object: r * 3 bytes (rank 0's is empty), distinct per rank.
std::string object_of(int r) {
  std::string s;
  for (int i = 0; i < 3 * r; ++i) s.push_back(static_cast<char>('a' + (r * 7 + i) % 26));
  if (r == 2) s[1] = '\0';  // bytes, not C strings
  return s;
}

class Objects : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  void run(const std::function<void(RankContext&, const CollectiveOptions&)>& body) {
    const std::string backend = std::get<0>(GetParam());
    auto errors = run_rank_contexts(world(), [&](RankContext& ctx) {
      body(ctx, CollectiveOptions().group(ctx.group));
    }, std::chrono::seconds(30), GroupOptions(), backend);
    for (int r = 0; r < world(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  }
  int world() const { return std::get<1>(GetParam()); }
};

TEST_P(Objects, BroadcastFromEveryRank) {
  run([&](RankContext& ctx, const CollectiveOptions& o) {
    for (int src = 0; src < ctx.world; ++src) {
      std::string s = ctx.rank == src ? object_of(src + 1) : "something else entirely";
      broadcast_object(s, src, o);
      EXPECT_EQ(s, object_of(src + 1)) << "src " << src;
    }
  });
}

TEST_P(Objects, AllGatherAndGatherUnevenSizes) {
  run([&](RankContext& ctx, const CollectiveOptions& o) {
    auto all = all_gather_object(object_of(ctx.rank), o);
    ASSERT_EQ(static_cast<int>(all.size()), ctx.world);
    for (int r = 0; r < ctx.world; ++r) EXPECT_EQ(all[r], object_of(r));
    const int dst = ctx.world - 1;
    auto got = gather_object(object_of(ctx.rank), dst, o);
    if (ctx.rank == dst) {
      ASSERT_EQ(static_cast<int>(got.size()), ctx.world);
      for (int r = 0; r < ctx.world; ++r) EXPECT_EQ(got[r], object_of(r));
    } else {
      EXPECT_TRUE(got.empty());
    }
  });
}

TEST_P(Objects, ScatterObjectList) {
  run([&](RankContext& ctx, const CollectiveOptions& o) {
    std::vector<std::vector<int64_t>> pieces;
    for (int r = 0; ctx.rank == 0 && r < ctx.world; ++r) pieces.push_back(std::vector<int64_t>(r, 100 + r));
    auto mine = scatter_object_list(pieces, 0, o);
    EXPECT_EQ(mine, std::vector<int64_t>(ctx.rank, 100 + ctx.rank));
  });
}

TEST_P(Objects, SendAndReceiveValuesAndStrings) {
  run([&](RankContext& ctx, const CollectiveOptions&) {
    auto p2p = P2POptions().group(ctx.group);
    struct Point { double x; int32_t id; };
    if (ctx.world == 1) {  // no peer: sending to oneself is refused, as for tensors
      try {
        send_object(Point{1, 2}, 0, p2p);
        ADD_FAILURE() << "a send to this rank was accepted";
      } catch (const InvalidArgument& e) {
        EXPECT_TRUE(testing::Contains(e.what(), "rank 0 is this rank")) << e.what();
      }
    } else if (ctx.rank == 1) {
      send_object(Point{2.5, 7}, 0, p2p);
      send_object(object_of(3), 0, p2p);
      send_object(std::string(), 0, p2p);
    } else if (ctx.rank == 0) {
      int from = -1;
      auto pt = recv_object<Point>(kAnySource, p2p, &from);
      EXPECT_EQ(from, 1);
      EXPECT_EQ(pt.x, 2.5);
      EXPECT_EQ(pt.id, 7);
      EXPECT_EQ(recv_object<std::string>(1, p2p), object_of(3));
      EXPECT_EQ(recv_object<std::string>(1, p2p), "");
    }
  });
}

TEST_P(Objects, BytesThatAreNotAWholeValueAreNamed) {
  run([&](RankContext& ctx, const CollectiveOptions& o) {
    // Every rank but 0 sends 3 bytes where an int64_t is expected.
    auto all = all_gather_object(ctx.rank == 0 ? std::string("12345678") : std::string("abc"), o);
    try {
      ObjectCodec<int64_t>::decode(all.back());
      if (ctx.world > 1) ADD_FAILURE() << "3 bytes decoded as an int64_t";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "received 3 bytes for a value of 8 bytes")) << e.what();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, Objects,
                         ::testing::Combine(::testing::Values("tcp", "shm"), ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace dtrain
