// batch_isend_irecv: sends and receives posted as one batch on every CPU
// backend, completing whatever their order, refused whole when one of them
// is wrong, and labelled in the flight recorder.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "harness/assertions.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using testing::Contains;
using testing::expect_no_errors;
using testing::RankContext;
using testing::run_rank_contexts;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A ring where every rank's batch holds its send before its receive, with
// messages far above what a receiver holds unexpected (so a send completes
// only once its receive is posted), and a second exchange in the other
// direction whose receive comes first: exact on every CPU backend.
TEST(BatchP2P, ARingInEitherOrderCompletesExactlyOnEveryBackend) {
  for (const std::string backend : {"tcp", "shm", "auto", "auto@2"}) {
    SCOPED_TRACE(backend);
    expect_no_errors(run_rank_contexts(
        4,
        [&](RankContext& ctx) {
          const int r = ctx.rank, n = ctx.world;
          const int right = (r + 1) % n, left = (r + n - 1) % n;
          const int64_t big = 4 << 20;  // 16 MiB of floats
          auto out = at::full({big}, static_cast<float>(r));
          auto in = at::empty({big});
          auto back_out = at::full({3}, r * 10, at::kLong);
          auto back_in = at::zeros({3}, at::kLong);
          auto works = batch_isend_irecv({P2POp(isend, out, right, ctx.group),
                                          P2POp(irecv, in, left, ctx.group),
                                          P2POp(irecv, back_in, right, ctx.group, 7),
                                          P2POp(isend, back_out, left, ctx.group, 7)});
          ASSERT_EQ(works.size(), 4u);
          // Waited in reverse: nothing waits on the posting order.
          for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
          EXPECT_TRUE(at::equal(in, at::full({big}, static_cast<float>(left))));
          EXPECT_TRUE(at::equal(back_in, at::full({3}, right * 10, at::kLong)));
          EXPECT_EQ(works[1]->source_rank(), left);
          EXPECT_EQ(works[2]->source_rank(), right);
        },
        std::chrono::seconds(60), GroupOptions(), backend));
  }
}

// Two messages on different tags, received in the other order than sent,
// and a receive from any rank inside a batch.
TEST(BatchP2P, ReceivesMatchByTagAndAnySourceNotByPosition) {
  expect_no_errors(run_rank_contexts(3, [&](RankContext& ctx) {
    const int r = ctx.rank;
    if (r == 0) {
      auto a = at::full({1 << 20}, 1.0), b = at::full({5}, 2.0);
      for (auto& w : batch_isend_irecv({P2POp(isend, a, 1, ctx.group, 1),
                                        P2POp(isend, b, 1, ctx.group, 2)}))
        w->wait();
    } else if (r == 1) {
      auto a = at::zeros({1 << 20}), b = at::zeros({5}), c = at::zeros({2}, at::kInt);
      auto works = batch_isend_irecv({P2POp(irecv, b, 0, ctx.group, 2),
                                      P2POp(irecv, c, kAnySource, ctx.group, 3),
                                      P2POp(irecv, a, 0, ctx.group, 1)});
      for (auto& w : works) w->wait();
      EXPECT_TRUE(at::equal(a, at::full({1 << 20}, 1.0)));
      EXPECT_TRUE(at::equal(b, at::full({5}, 2.0)));
      EXPECT_TRUE(at::equal(c, at::full({2}, 42, at::kInt)));
      EXPECT_EQ(works[1]->source_rank(), 2);
    } else {
      batch_isend_irecv({P2POp(isend, at::full({2}, 42, at::kInt), 1, ctx.group, 3)})[0]->wait();
    }
  }));
}

WorkPtr not_a_p2p_function(at::Tensor, int, const P2POptions&) { return nullptr; }

// A batch with one wrong operation is refused whole, naming it, before
// anything is numbered or posted: the next batch's sends are #0.
TEST(BatchP2P, AWrongOperationRefusesTheWholeBatchNamingIt) {
  expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    const int peer = 1 - ctx.rank;
    auto t = at::zeros({4});
    EXPECT_EQ(error_of([&] { batch_isend_irecv({}); }),
              "batch_isend_irecv: the list of operations is empty");
    EXPECT_EQ(error_of([&] {
                batch_isend_irecv({P2POp(isend, t, peer, ctx.group),
                                   P2POp(not_a_p2p_function, t, peer, ctx.group)});
              }),
              "batch_isend_irecv: operation 1's op is neither dtrain::isend nor dtrain::irecv");
    auto other = create_process_group("tcp", std::make_shared<PrefixStore>("other", ctx.store),
                                      ctx.rank, 2, GroupOptions().name("other"));
    EXPECT_EQ(error_of([&] {
                batch_isend_irecv({P2POp(isend, t, peer, ctx.group), P2POp(irecv, t, peer, other)});
              }),
              "batch_isend_irecv: operation 1 uses another group than operation 0 (group "
              "'other' against 'default'); every operation must use the same group");
    EXPECT_EQ(error_of([&] {
                batch_isend_irecv(
                    {P2POp(isend, t, peer, ctx.group), P2POp(irecv, t, 5, ctx.group)});
              }),
              "batch_isend_irecv: operation 1: recv: src rank 5 is not a member of group "
              "'default' (global ranks 0, 1)");
    EXPECT_EQ(error_of([&] {
                batch_isend_irecv({P2POp(isend, t, peer, ctx.group),
                                   P2POp(irecv, t, peer, ctx.group, -1)});
              }),
              "batch_isend_irecv: operation 1: recv: tag must be >= 0, got -1");
    auto works = batch_isend_irecv({P2POp(isend, at::full({4}, ctx.rank + 1.0), peer, ctx.group),
                                    P2POp(irecv, t, peer, ctx.group)});
    for (auto& w : works) w->wait();
    EXPECT_TRUE(at::equal(t, at::full({4}, peer + 1.0)));
    EXPECT_EQ(works[0]->description().rfind("send #0 on group 'default'", 0), 0u)
        << works[0]->description();
    EXPECT_EQ(works[1]->description().rfind("recv #1 on group 'default'", 0), 0u)
        << works[1]->description();
  }));
}

// The flight recorder labels each operation with its batch.
TEST(BatchP2P, TheFlightRecorderLabelsEachOperationWithItsBatch) {
  testing::TempDir dir;
  std::string path;
  expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    const int peer = 1 - ctx.rank;
    auto t = at::zeros({3});
    for (int batch = 0; batch < 2; ++batch)
      for (auto& w : batch_isend_irecv({P2POp(irecv, t, peer, ctx.group),
                                        P2POp(isend, at::ones({3}), peer, ctx.group)}))
        w->wait();
    ctx.group->barrier()->wait();
    if (ctx.rank == 0) path = dump_flight_recorder(dir.path());
    ctx.group->barrier()->wait();
  }));
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  for (const char* part : {"batch_isend_irecv #0 (1 of 2)\"", "batch_isend_irecv #0 (2 of 2)\"",
                           "batch_isend_irecv #1 (1 of 2)\"", "batch_isend_irecv #1 (2 of 2)\""})
    EXPECT_TRUE(Contains(text.str(), std::string("\"label\": \"") + part)) << part << text.str();
}

}  // namespace
}  // namespace dtrain
