// Where a group's ranks are (transport/topology.h), the host identity that
// decides it (shm/node.h, DTRAIN_HOST_ID), and the subset view that the
// two-level algorithms run over (transport/subset.h).

#include <gtest/gtest.h>

#include <thread>

#include "dtrain/errors.h"
#include "dtrain/store/hash_store.h"
#include "harness/scoped_env.h"
#include "transport/shm/node.h"
#include "transport/subset.h"
#include "transport/topology.h"

namespace dtrain::transport {
namespace {

TEST(Topology, PlacesEachRankOnItsHost) {
  const Topology t({{0, 2}, {1, 3}});
  EXPECT_EQ(t.size(), 4);
  EXPECT_EQ(t.host_of, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(t.local_index, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_TRUE(t.same_host(0, 2));
  EXPECT_FALSE(t.same_host(0, 1));
  EXPECT_TRUE(t.uniform());
  EXPECT_EQ(t.describe(), "2 hosts (ranks 0,2 | ranks 1,3)");
  EXPECT_FALSE(Topology({{0, 1}, {2}}).uniform());
  EXPECT_EQ(Topology({{0, 1, 2}}).describe(), "1 host (ranks 0,1,2)");
}

TEST(Topology, DiscoveredFromEveryRanksHostIdentity) {
  auto store = std::make_shared<HashStore>(std::chrono::seconds(10));
  std::vector<Topology> seen(5);
  std::vector<std::thread> threads;
  for (int r = 0; r < 5; ++r)
    threads.emplace_back([&, r] {
      shm::set_thread_host_id(r % 2 ? "odd" : "even");
      seen[r] = discover_topology(*store, r, 5);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(seen[r].hosts, (std::vector<std::vector<int>>{{0, 2, 4}, {1, 3}})) << "rank " << r;
    EXPECT_FALSE(seen[r].uniform());
  }
}

TEST(Topology, HostIdSplitsAMachineButNeverJoinsTwo) {
  const auto plain = shm::node_key();
  std::string a, b;
  {
    testing::ScopedEnv id("DTRAIN_HOST_ID", "a");
    a = shm::node_key();
  }
  {
    testing::ScopedEnv id("DTRAIN_HOST_ID", "b");
    b = shm::node_key();
  }
  EXPECT_NE(a, b);
  EXPECT_NE(a, plain);
  // The machine's own identity stays in the key: the same id on another
  // machine (another boot id, namespace or /dev/shm) is another key.
  EXPECT_EQ(a.rfind(plain, 0), 0u) << a;
}

// Records what the view asks of its base.
class FakeTransport final : public Transport {
 public:
  struct Call {
    std::string op;
    int peer;
    uint64_t tag;
  };
  explicit FakeTransport(int rank) : rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return 8; }
  RequestPtr isend(int peer, uint64_t tag, const void*, size_t) override {
    calls.push_back({"isend", peer, tag});
    return nullptr;
  }
  RequestPtr irecv(int peer, uint64_t tag, void*, size_t) override {
    calls.push_back({"irecv", peer, tag});
    return nullptr;
  }
  RequestPtr irecv_any(uint64_t, void*, size_t) override { return nullptr; }
  void fail(std::exception_ptr e) override { error_ = e; }
  void close(std::exception_ptr e) override { error_ = e; }
  std::exception_ptr error() const override { return error_; }
  std::vector<Call> calls;

 private:
  int rank_;
  std::exception_ptr error_;
};

TEST(Subset, NumbersItsRanksAndSharesTheBasesFate) {
  FakeTransport base(5);
  Subset view(base, {1, 5, 7});
  EXPECT_EQ(view.rank(), 1);
  EXPECT_EQ(view.size(), 3);
  view.isend(2, 42, nullptr, 0);
  view.irecv(0, 43, nullptr, 0);
  ASSERT_EQ(base.calls.size(), 2u);
  EXPECT_EQ(base.calls[0].peer, 7);
  EXPECT_EQ(base.calls[0].tag, 42u);
  EXPECT_EQ(base.calls[1].peer, 1);
  EXPECT_THROW(view.isend(3, 1, nullptr, 0), InvalidArgument);
  view.fail(std::make_exception_ptr(NetworkError("gone")));
  EXPECT_TRUE(base.error() != nullptr);
  EXPECT_TRUE(view.error() != nullptr);
}

}  // namespace
}  // namespace dtrain::transport
