// The TCP store's service without sockets (store/store_service.h): requests
// go in as frames, and every answer is seen at the seam the server
// implements, with the connection it goes to.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "store/c10d_wire.h"
#include "store/store_service.h"
#include "store/wire.h"

namespace dtrain {
namespace {

using store_detail::SharedValue;
using store_detail::StoreService;

// What the service asked of the server's connections, in order.
struct Recorded : StoreService::Connections {
  struct Answer {
    uint64_t conn;
    uint16_t status;  // a dtrain reply's; 0 for c10d bytes
    std::string value;
    bool parked_answer;
    bool unpark;
  };
  std::vector<Answer> answers;
  std::vector<uint64_t> parked;

  static Answer decode(uint64_t conn, const std::vector<uint8_t>& head, const SharedValue& value,
                       bool parked_answer, bool unpark) {
    const bool dtrain = head.size() >= wire::kHeaderBytes && head[0] == 'D';
    const uint16_t status = dtrain ? wire::decode_header(head.data()).opcode : 0;
    std::string v = value ? std::string(value->begin(), value->end()) : "";
    if (!dtrain) v.insert(0, std::string(head.begin(), head.end()));
    return {conn, status, v, parked_answer, unpark};
  }
  void reply(uint64_t conn, std::vector<uint8_t> head, SharedValue value) override {
    answers.push_back(decode(conn, head, value, false, false));
  }
  void park(uint64_t conn) override { parked.push_back(conn); }
  void answer_parked(uint64_t conn, std::vector<uint8_t> head, SharedValue value,
                     bool unpark) override {
    answers.push_back(decode(conn, head, value, true, unpark));
  }
};

void send(StoreService& s, uint64_t conn, wire::Writer w) {
  const auto frame = w.finish();
  const auto h = wire::decode_header(frame.data());
  wire::Reader r(frame.data() + wire::kHeaderBytes, h.length);
  s.handle(conn, h, r);
}

bool send_c10d(StoreService& s, uint64_t conn, c10d_wire::Op op, c10d_wire::Writer w) {
  const auto bytes = w.take();
  c10d_wire::Reader r(bytes.data(), bytes.size());
  return s.handle_c10d(conn, op, r);
}

TEST(StoreService, AParkedGetIsAnsweredOnItsOwnConnectionWhenAnotherSetsItsKey) {
  Recorded conns;
  StoreService s(1 << 20, 1024, false, conns);
  send(s, 1, std::move(wire::Writer(wire::kGet, 7).str("k").u32(60000)));
  EXPECT_EQ(conns.parked, std::vector<uint64_t>{1});
  EXPECT_TRUE(conns.answers.empty());
  EXPECT_EQ(s.parked(), 1u);

  send(s, 2, std::move(wire::Writer(wire::kSet, 8).str("k").str("v")));
  ASSERT_EQ(conns.answers.size(), 2u);
  // The parked GET is answered first (the SET's own reply follows the key).
  EXPECT_EQ(conns.answers[0].conn, 1u);
  EXPECT_EQ(conns.answers[0].status, wire::kOk);
  EXPECT_EQ(conns.answers[0].value, "v");
  EXPECT_TRUE(conns.answers[0].parked_answer);
  EXPECT_TRUE(conns.answers[0].unpark);
  EXPECT_EQ(conns.answers[1].conn, 2u);
  EXPECT_EQ(conns.answers[1].status, wire::kOk);
  EXPECT_FALSE(conns.answers[1].parked_answer);
  EXPECT_EQ(s.parked(), 0u);
}

TEST(StoreService, AnExpiredWaitGetsTimeoutAndADroppedConnectionsWaitGetsNothing) {
  Recorded conns;
  StoreService s(1 << 20, 1024, false, conns);
  send(s, 1, std::move(wire::Writer(wire::kWait, 1).u32(0).u32(1).str("a")));
  send(s, 3, std::move(wire::Writer(wire::kWait, 2).u32(0).u32(1).str("a")));
  EXPECT_EQ(s.parked(), 2u);
  s.drop_connection(3);
  s.expire(StoreService::Clock::now() + std::chrono::seconds(1));
  ASSERT_EQ(conns.answers.size(), 1u);
  EXPECT_EQ(conns.answers[0].conn, 1u);
  EXPECT_EQ(conns.answers[0].status, wire::kTimeout);
  EXPECT_TRUE(conns.answers[0].unpark);
  EXPECT_EQ(s.parked(), 0u);
  EXPECT_EQ(s.next_deadline(), StoreService::Clock::time_point::max());
}

TEST(StoreService, ARefusedRequestIsAnErrorReplyAndAC10dWaitDoesNotHoldItsConnection) {
  Recorded conns;
  StoreService s(1 << 20, 1024, false, conns);
  send(s, 1, std::move(wire::Writer(wire::kSet, 1).str("n").str("not a number")));
  send(s, 1, std::move(wire::Writer(wire::kAdd, 2).str("n").i64(1)));
  ASSERT_EQ(conns.answers.size(), 2u);
  EXPECT_EQ(conns.answers[1].status, wire::kError);

  namespace cw = c10d_wire;
  EXPECT_TRUE(send_c10d(s, 4, cw::Op::kWait, std::move(cw::Writer().u64(1).str("late"))));
  EXPECT_TRUE(conns.parked.empty());  // CANCEL_WAIT may come meanwhile
  EXPECT_TRUE(send_c10d(s, 5, cw::Op::kSet, std::move(cw::Writer().str("late").str("x"))));
  ASSERT_EQ(conns.answers.size(), 3u);
  EXPECT_EQ(conns.answers[2].conn, 4u);
  EXPECT_EQ(conns.answers[2].value, std::string(1, char(cw::kStopWaiting)));
  EXPECT_FALSE(conns.answers[2].unpark);
  EXPECT_FALSE(send_c10d(s, 5, cw::Op::kQueuePush, cw::Writer()));  // not supported
}

// SET_EPHEMERAL: the key lives while the connection that set it does;
// set or deleted since by anyone, it is no longer tied; a parked GET
// waiting for it is answered; at most 64 per connection.
TEST(StoreService, AnEphemeralKeyIsDeletedWhenItsConnectionClosesUnlessSetOrDeletedSince) {
  Recorded conns;
  StoreService s(1 << 20, 1024, false, conns);
  auto stored = [&](const std::string& key) {  // a GET that does not wait, from connection 9
    send(s, 9, std::move(wire::Writer(wire::kGet, 1).str(key).u32(0)));
    s.expire(StoreService::Clock::now() + std::chrono::seconds(1));
    const auto a = conns.answers.back();
    EXPECT_EQ(a.conn, 9u);
    return a.status == wire::kOk;
  };
  send(s, 5, std::move(wire::Writer(wire::kGet, 1).str("alive/a").u32(60000)));  // parked
  send(s, 1, std::move(wire::Writer(wire::kSetEphemeral, 2).str("alive/a").str("pid 1")));
  ASSERT_GE(conns.answers.size(), 2u);
  EXPECT_EQ(conns.answers[0].conn, 5u);
  EXPECT_EQ(conns.answers[0].value, "pid 1");
  send(s, 1, std::move(wire::Writer(wire::kSetEphemeral, 3).str("alive/b").str("x")));
  send(s, 2, std::move(wire::Writer(wire::kSetEphemeral, 4).str("alive/c").str("y")));
  send(s, 2, std::move(wire::Writer(wire::kSet, 5).str("alive/b").str("now 2's, plainly")));
  EXPECT_TRUE(stored("alive/a") && stored("alive/b") && stored("alive/c"));
  s.drop_connection(1);
  EXPECT_FALSE(stored("alive/a")) << "its connection closed";
  EXPECT_TRUE(stored("alive/b")) << "set since by a plain SET: no longer tied";
  EXPECT_TRUE(stored("alive/c")) << "another connection's";
  send(s, 3, std::move(wire::Writer(wire::kSetEphemeral, 6).str("alive/c").str("3's now")));
  s.drop_connection(2);
  EXPECT_TRUE(stored("alive/c")) << "set since by connection 3";
  s.drop_connection(3);
  EXPECT_FALSE(stored("alive/c"));
  for (int i = 0; i < 64; ++i)
    send(s, 4, std::move(wire::Writer(wire::kSetEphemeral, 7).str("k" + std::to_string(i)).str("v")));
  EXPECT_EQ(conns.answers.back().status, wire::kOk);
  send(s, 4, std::move(wire::Writer(wire::kSetEphemeral, 8).str("k64").str("v")));
  EXPECT_EQ(conns.answers.back().status, wire::kError);
  EXPECT_FALSE(stored("k64"));
  send(s, 4, std::move(wire::Writer(wire::kSetEphemeral, 9).str("k0").str("again")));
  EXPECT_EQ(conns.answers.back().status, wire::kOk) << "a key it holds may be set again";
  s.drop_connection(4);
  EXPECT_FALSE(stored("k0"));
}

}  // namespace
}  // namespace dtrain
