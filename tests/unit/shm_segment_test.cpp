// shm::Segment ownership: moving hands over the name, mapping, descriptor
// and liveness lock; move-assignment releases what the target held first.
// Attaching: what rank 0 published in the store is checked before use.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <optional>
#include <utility>

#include "dtrain/errors.h"
#include "dtrain/store/hash_store.h"
#include "harness/assertions.h"
#include "harness/scoped_env.h"
#include "transport/shm/attach.h"
#include "transport/shm/node.h"
#include "transport/shm/segment.h"
#include "transport/shm/slots.h"

namespace dtrain::shm {
namespace {

// Whether `name` still exists in /dev/shm.
bool name_exists(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// Whether [addr, addr+bytes) is mapped in this process (msync fails with
// ENOMEM on unmapped pages).
bool is_mapped(void* addr, size_t bytes) {
  return ::msync(addr, bytes, MS_ASYNC) == 0 || errno != ENOMEM;
}

TEST(ShmSegment, MoveAssignmentReleasesTheTargetAndTakesTheSource) {
  const size_t kA = 4096, kB = 3 * 4096;
  Segment a = Segment::create(kA);
  Segment b = Segment::create(kB);
  std::memset(b.data(), 0x5b, kB);
  const std::string a_name = a.name(), b_name = b.name();
  void* const a_data = a.data();
  void* const b_data = b.data();
  ASSERT_NE(a_name, b_name);

  a = std::move(b);

  // a is now b's segment, unchanged...
  EXPECT_EQ(a.name(), b_name);
  EXPECT_EQ(a.size(), kB);
  EXPECT_EQ(a.data(), b_data);
  EXPECT_EQ(static_cast<unsigned char*>(a.data())[kB - 1], 0x5b);
  // ...its former segment is unlinked and unmapped...
  EXPECT_FALSE(name_exists(a_name)) << a_name << " was not unlinked";
  EXPECT_FALSE(is_mapped(a_data, kA)) << "the replaced mapping is still there";
  // ...and b is empty.
  EXPECT_TRUE(b.name().empty());
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(b.data(), nullptr);

  // a holds b's descriptor: its slot lock is seen from another opening.
  a.lock_slot(1);
  Segment peer = Segment::open(b_name, kB);
  EXPECT_TRUE(peer.slot_locked_by_other(1));
  EXPECT_FALSE(peer.slot_locked_by_other(0));

  // Self-move leaves the segment as it was.
  Segment& same = a;
  a = std::move(same);
  EXPECT_EQ(a.name(), b_name);
  EXPECT_EQ(a.size(), kB);
  EXPECT_EQ(static_cast<unsigned char*>(a.data())[0], 0x5b);

  // Assigning an empty segment releases a's: the name goes, the lock drops.
  a = Segment();
  EXPECT_TRUE(a.name().empty());
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_FALSE(name_exists(b_name)) << b_name << " outlived its last owner";
  EXPECT_FALSE(peer.slot_locked_by_other(1)) << "the lock outlived the descriptor";
}

TEST(ShmSegment, MoveConstructionLeavesTheSourceEmpty) {
  Segment a = Segment::create(4096);
  const std::string name = a.name();
  void* const data = a.data();
  Segment b(std::move(a));
  EXPECT_EQ(b.name(), name);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.size(), 4096u);
  EXPECT_TRUE(a.name().empty());  // NOLINT(bugprone-use-after-move): checking it
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.size(), 0u);
  { Segment gone = std::move(b); }
  EXPECT_FALSE(name_exists(name));
  EXPECT_FALSE(is_mapped(data, 4096));
}

}  // namespace
// DTRAIN_SHM_CHUNK_BYTES: auto (the default) gives 1 MiB halves to groups
// of up to 4 ranks, then less within 8 MiB a group, at least 128 KiB; a
// number is taken as it is; anything else is refused naming the variable.
TEST(ShmChunkBytes, AutoSizesByRanksAndANumberIsTakenAsItIs) {
  const size_t KiB = 1024;
  for (const char* value : {"", "auto"}) {
    std::optional<testing::ScopedEnv> set;
    if (*value) set.emplace("DTRAIN_SHM_CHUNK_BYTES", value);
    EXPECT_EQ(Slots::chunk_bytes(2), 1024 * KiB);
    EXPECT_EQ(Slots::chunk_bytes(4), 1024 * KiB);
    EXPECT_EQ(Slots::chunk_bytes(8), 512 * KiB);
    EXPECT_EQ(Slots::chunk_bytes(16), 256 * KiB);
    EXPECT_EQ(Slots::chunk_bytes(24), 168 * KiB);
    EXPECT_EQ(Slots::chunk_bytes(64), 128 * KiB);
  }
  testing::ScopedEnv number("DTRAIN_SHM_CHUNK_BYTES", "4096");
  EXPECT_EQ(Slots::chunk_bytes(16), 4096u);
  testing::ScopedEnv word("DTRAIN_SHM_CHUNK_BYTES", "big");
  EXPECT_THROW(Slots::chunk_bytes(2), InvalidArgument);
}

// The segment's name and size that rank 0 publishes come from the store,
// which other programs may write to: a value that is not "<name> <bytes>"
// fails naming the key and the value (it failed as std::stoull's bare
// "stoull", or an internal assertion when it had no space).
TEST(ShmAttach, AMalformedSegmentInTheStoreFailsNamingIt) {
  SegmentPlan plan;
  plan.what = "shm: setting up group 'g' (rank 1/2)";
  for (const std::string bad : {"bogus", "/dtrain-x abc", "/dtrain-x -5", "/dtrain-x 99999999999999999999",
                                "/dtrain-x ", "/dtrain-x 12 "}) {
    HashStore store(std::chrono::seconds(10));
    store.set("shm/node/0", node_key());
    store.set("shm/segment", bad);
    const auto what = testing::what_thrown<InvalidArgument>([&] { attach_segment(store, 1, 2, plan); });
    EXPECT_TRUE(testing::Contains(what, plan.what + ": the store's 'shm/segment' is '" + bad +
                                            "', not a segment's name and size"));
  }
}

}  // namespace dtrain::shm
