// The snapshot keeper dtrain-run runs per host (checkpoint/snapshot_keeper.h):
// what it keeps, its memory bound, and hostile requests on its socket.

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "checkpoint/snapshot_keeper.h"
#include "dtrain/errors.h"

namespace dtrain::snapshot {
namespace {

using snapshot_wire::Op;
using snapshot_wire::Request;

Request put(int64_t step, uint32_t rank, size_t bytes, char fill = 'x') {
  return {Op::Put, step, rank, 4, std::string(bytes, fill)};
}
snapshot_wire::Listing listing(Keeper& k) {
  auto [ok, body] = k.handle({Op::List, 0, 0, 0, {}});
  EXPECT_TRUE(ok) << body;
  return snapshot_wire::decode_listing(body, "test");
}

TEST(SnapshotKeeper, KeepsTheNewestCompleteSnapshotAndTheOneBeingWrittenOnly) {
  Keeper k("/tmp", 1 << 20);
  EXPECT_EQ(listing(k).step, -1);
  EXPECT_TRUE(k.handle(put(0, 0, 100)).first);
  EXPECT_TRUE(k.handle(put(0, 2, 100)).first);
  EXPECT_EQ(listing(k).step, -1);  // not complete until said
  EXPECT_TRUE(k.handle({Op::Commit, 0, 0, 4, {}}).first);
  EXPECT_TRUE(k.handle({Op::Commit, 0, 1, 4, {}}).first);  // a second rank saying it again
  auto l = listing(k);
  EXPECT_EQ(l.step, 0);
  ASSERT_EQ(l.parts.size(), 2u);
  EXPECT_EQ(l.parts[1], std::make_pair(2u, uint64_t{100}));
  EXPECT_TRUE(k.handle(put(5, 0, 300)).first);
  EXPECT_TRUE(k.handle(put(10, 0, 50)).first);  // step 5 was never completed: replaced
  EXPECT_EQ(k.bytes_held(), 250u);
  auto refused = k.handle({Op::Commit, 5, 0, 4, {}});
  EXPECT_FALSE(refused.first);
  EXPECT_EQ(refused.second, "this host's keeper has no snapshot of step 5 being written");
  EXPECT_TRUE(k.handle({Op::Commit, 10, 0, 4, {}}).first);
  EXPECT_EQ(k.bytes_held(), 50u);  // step 0 went when step 10 was complete
  EXPECT_EQ(listing(k).step, 10);
  auto got = k.handle({Op::Get, 10, 0, 4, {}});
  EXPECT_TRUE(got.first);
  EXPECT_EQ(got.second, std::string(50, 'x'));
  EXPECT_FALSE(k.handle({Op::Get, 10, 1, 4, {}}).first);
  EXPECT_FALSE(k.handle({Op::Get, 0, 0, 4, {}}).first);
}

TEST(SnapshotKeeper, APartPastTheMemoryLimitIsRefusedNamingTheVariable) {
  Keeper k("/tmp", 1000);
  EXPECT_TRUE(k.handle(put(0, 0, 600)).first);
  auto refused = k.handle(put(0, 1, 600));
  EXPECT_FALSE(refused.first);
  EXPECT_NE(refused.second.find("would hold 1200 bytes with rank 1's part, over its limit of 1000 "
                                "(DTRAIN_SNAPSHOT_MEMORY)"),
            std::string::npos)
      << refused.second;
  EXPECT_TRUE(k.handle({Op::Commit, 0, 0, 4, {}}).first);
  EXPECT_FALSE(k.handle(put(1, 0, 600)).first);  // the complete one counts
  EXPECT_TRUE(k.handle(put(1, 0, 400)).first);
  EXPECT_EQ(k.bytes_held(), 1000u);
}

// Raw bytes on the keeper's socket: the reply's status and text.
std::pair<uint32_t, std::string> raw(const std::string& path, const std::string& bytes) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  ::shutdown(fd, SHUT_WR);
  std::string reply;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) reply.append(buf, n);
  ::close(fd);
  if (reply.size() < 12) return {99, reply};
  uint32_t status;
  std::memcpy(&status, reply.data(), 4);
  return {status, reply.substr(12)};
}

std::string head(const char* magic, uint32_t op, int64_t step, uint32_t rank, uint32_t world, uint64_t n) {
  std::string h(magic, 4);
  h.append(reinterpret_cast<const char*>(&op), 4);
  h.append(reinterpret_cast<const char*>(&step), 8);
  h.append(reinterpret_cast<const char*>(&rank), 4);
  h.append(reinterpret_cast<const char*>(&world), 4);
  h.append(reinterpret_cast<const char*>(&n), 8);
  return h;
}

TEST(SnapshotKeeper, HostileRequestsAreRefusedUnreadAndTheKeeperServesOn) {
  Keeper k("/tmp", 1 << 20);
  const auto& path = k.socket_path();
  auto bad_magic = raw(path, head("XXXX", 3, 0, 0, 4, 0));
  EXPECT_EQ(bad_magic.first, 1u);
  EXPECT_EQ(bad_magic.second, "snapshot keeper: a request without the protocol's magic");
  auto huge = raw(path, head("DTSN", 1, 0, 0, 4, uint64_t{1} << 60));
  EXPECT_EQ(huge.first, 1u);
  EXPECT_NE(huge.second.find("a part of 1152921504606846976 bytes is over the 1048576 bytes"), std::string::npos)
      << huge.second;
  EXPECT_EQ(raw(path, head("DTSN", 9, 0, 0, 4, 0)).second, "snapshot keeper: unknown operation 9");
  EXPECT_EQ(raw(path, head("DTSN", 1, 0, 7, 4, 0)).second, "snapshot keeper: rank 7 is not below the world size 4");
  EXPECT_EQ(raw(path, "DTS").first, 99u);  // cut short: dropped, no reply
  EXPECT_EQ(k.bytes_held(), 0u);
  // Still serving: a real request over the socket.
  const auto body = snapshot_wire::call(path, {Op::List, 0, 0, 0, {}}, 1 << 16,
                                        snapshot_wire::Clock::now() + std::chrono::seconds(5), "test");
  EXPECT_EQ(snapshot_wire::decode_listing(body, "test").step, -1);
}

TEST(SnapshotKeeper, ListingsThatDoNotAddUpAreRefused) {
  snapshot_wire::Listing l{1, 3, 2, {{0, 10}, {1, 10}}};
  EXPECT_NO_THROW(snapshot_wire::decode_listing(snapshot_wire::encode_listing(l), "x"));
  l.parts = {{1, 10}, {0, 10}};
  EXPECT_THROW(snapshot_wire::decode_listing(snapshot_wire::encode_listing(l), "x"), InvalidArgument);
  l.parts = {{0, 10}, {1, 10}, {1, 10}};
  EXPECT_THROW(snapshot_wire::decode_listing(snapshot_wire::encode_listing(l), "x"), InvalidArgument);
  auto bytes = snapshot_wire::encode_listing({1, 3, 2, {{0, 10}}});
  EXPECT_THROW(snapshot_wire::decode_listing(bytes.substr(0, bytes.size() - 1), "x"), InvalidArgument);
  EXPECT_THROW(snapshot_wire::decode_listing(bytes + "z", "x"), InvalidArgument);
}

}  // namespace
}  // namespace dtrain::snapshot
