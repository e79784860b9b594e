// dtrain's TCP store as torchrun's agent store, driven by libtorch's own
// c10d::TCPStore client (what a dtrain worker under dtrain-run or torchrun
// uses when TORCHELASTIC_USE_AGENT_STORE=True, and what PyTorch programs
// speak): every operation, beside a dtrain client on the same keys.

#include <gtest/gtest.h>

#include <thread>

#include "dtrain/errors.h"
#include "dtrain/store/tcp_store.h"
#include "harness/assertions.h"
#include "store/agent_store.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::Contains;
using testing::what_thrown;

TEST(AgentStore, LibtorchsClientIsServedByDtrainsStore) {
  TcpStore server(TcpStoreOptions().host("127.0.0.1").port(0).is_server(true).timeout(5s));
  auto torch = connect_agent_store("127.0.0.1", server.port(), 5s);

  // c10d's client puts "/" before every key it is given (PyTorch does the
  // same), so a dtrain client sees "a" as "/a".
  torch->set("a", "from libtorch");
  EXPECT_EQ(server.get_string("/a"), "from libtorch");
  server.set("/b", "from dtrain");
  EXPECT_EQ(torch->get_string("b"), "from dtrain");

  EXPECT_EQ(torch->add("n", 5), 5);
  EXPECT_EQ(server.add("/n", 1), 6);
  EXPECT_EQ(torch->add("n", 0), 6);

  auto cas = [&](const std::string& expected, const std::string& desired) {
    auto v = torch->compare_set("c", {expected.begin(), expected.end()},
                                {desired.begin(), desired.end()});
    return std::string(v.begin(), v.end());
  };
  EXPECT_EQ(cas("", "one"), "one");
  EXPECT_EQ(cas("nope", "two"), "one");
  EXPECT_EQ(cas("one", "two"), "two");

  EXPECT_TRUE(torch->check({"a", "b"}));
  EXPECT_FALSE(torch->check({"a", "absent"}));
  EXPECT_TRUE(torch->delete_key("a"));
  EXPECT_FALSE(server.check({"/a"}));
  EXPECT_EQ(torch->num_keys(), server.num_keys());

  // A wait is answered when a dtrain client creates the key.
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    server.set("/late", "1");
  });
  torch->wait({"late"}, 5s);
  later.join();
  EXPECT_EQ(torch->get_string("late"), "1");
}

TEST(AgentStore, AWaitThatTimesOutIsATimeoutErrorNamingTheStore) {
  TcpStore server(TcpStoreOptions().host("127.0.0.1").port(0).is_server(true).timeout(5s));
  auto torch = connect_agent_store("127.0.0.1", server.port(), 5s);
  const auto msg = what_thrown<TimeoutError>([&] { torch->wait({"never"}, 300ms); });
  EXPECT_TRUE(Contains(msg, "torchrun agent store 127.0.0.1:" + std::to_string(server.port())))
      << msg;
}

// get() waits with this store's timeout, passed to each wait, instead of
// setting the shared c10d client's timeout on every call (issue 30, item
// 14): a get that times out says so after the store's timeout, and one
// whose key comes in time returns it, while another thread's explicit wait
// keeps its own timeout.
TEST(AgentStore, GetWaitsWithTheStoresTimeoutWithoutSettingTheClients) {
  TcpStore server(TcpStoreOptions().host("127.0.0.1").port(0).is_server(true).timeout(5s));
  auto torch = connect_agent_store("127.0.0.1", server.port(), 5s);
  torch->set_timeout(300ms);
  const auto start = std::chrono::steady_clock::now();
  const auto msg = what_thrown<TimeoutError>([&] { torch->get("absent"); });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(Contains(msg, "(key absent)")) << msg;
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 3s);
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    server.set("/soon", "1");
  });
  EXPECT_EQ(torch->get_string("soon"), "1");
  later.join();
  torch->wait({"soon"}, 5s);
}

}  // namespace
}  // namespace dtrain
