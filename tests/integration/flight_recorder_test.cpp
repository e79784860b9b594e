// The flight recorder in one process: what a dump holds (every group's
// collectives and point-to-point operations with their states), the ring
// keeping only the last 2000, and the error without a directory.

#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>
#include <sstream>

#include "harness/assertions.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using testing::Contains;

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/dtrain-recorder-XXXXXX";
    path = mkdtemp(tmpl) ? tmpl : "";
  }
  ~TempDir() { std::system(("rm -rf " + path).c_str()); }
  std::string path;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(FlightRecorder, DumpHoldsEveryGroupsOperationsAndStates) {
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  std::string path;
  testing::expect_no_errors(testing::run_ranks(2, [&](ProcessGroup& g) {
    for (int i = 0; i < 3; ++i) g.all_reduce(at::ones({2, 3}), ReduceOp::MAX)->wait();
    auto t = at::zeros({5}, at::kLong);
    if (g.rank() == 0) g.send(t, 1, 0)->wait();
    else g.recv(t, 0, 0)->wait();
    g.barrier()->wait();
    if (g.rank() == 0) path = dump_flight_recorder(dir.path);
    g.barrier()->wait();
  }));
  const auto text = read_file(path);
  EXPECT_TRUE(Contains(text, "\"format\": \"dtrain-flight-recorder\", \"version\": 1"));
  EXPECT_TRUE(Contains(text, "\"reason\": \"dump_flight_recorder()\""));
  // Both ranks' groups live in this process: 2 x 3 all_reduces.
  EXPECT_EQ(count(text, "\"op\": \"all_reduce\", \"kind\": \"collective\", \"dtype\": \"Float\", "
                        "\"shape\": [2, 3], \"numel\": 6, \"root\": -1, \"reduce_op\": \"MAX\", "
                        "\"state\": \"completed\""),
            6u)
      << text;
  EXPECT_EQ(count(text, "\"op\": \"send\", \"kind\": \"p2p\", \"dtype\": \"Long\", \"shape\": [5], "
                        "\"numel\": 5, \"root\": 1"),
            1u);
  EXPECT_EQ(count(text, "\"op\": \"recv\", \"kind\": \"p2p\""), 1u);
  // Both ranks' first barrier; rank 1 may have issued its second one too.
  EXPECT_GE(count(text, "\"op\": \"barrier\""), 2u);
}

// auto over two stand-in hosts is one group: each collective is one entry
// per rank, with no entries of inner groups (the nested groups it once was
// recorded a reduce and a broadcast inside each host, and an all_reduce
// among the hosts' leaders, for every all_reduce).
TEST(FlightRecorder, AutoOverHostsRecordsEachCollectiveOnce) {
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  std::string path;
  testing::expect_no_errors(testing::run_ranks(4, [&](ProcessGroup& g) {
    for (int i = 0; i < 3; ++i) g.all_reduce(at::ones({300001}, at::kDouble), ReduceOp::MIN)->wait();
    g.barrier()->wait();
    if (g.rank() == 0) path = dump_flight_recorder(dir.path);
    g.barrier()->wait();
  }, std::chrono::seconds(30), GroupOptions(), "auto@2"));
  const auto text = read_file(path);
  EXPECT_EQ(count(text, "\"op\": \"all_reduce\", \"kind\": \"collective\", \"dtype\": \"Double\", "
                        "\"shape\": [300001]"),
            12u)
      << text;
  EXPECT_EQ(count(text, "\"dtype\": \"Double\", \"shape\": [300001]"), 12u) << text;
}

// auto on a CUDA-enabled libtorch is a routing layer over its CPU group:
// still one entry per rank and collective (the inner group records none),
// and none for agreeing on the CUDA path. It once recorded each collective
// twice, after an all_reduce of its own.
TEST(FlightRecorder, AutoWithCudaRoutingRecordsEachCollectiveOnce) {
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  std::string path;
  testing::expect_no_errors(testing::run_ranks(2, [&](ProcessGroup& g) {
    for (int i = 0; i < 3; ++i) g.all_reduce(at::ones({300001}, at::kDouble), ReduceOp::MIN)->wait();
    g.barrier()->wait();
    if (g.rank() == 0) path = dump_flight_recorder(dir.path);
    g.barrier()->wait();
  }, std::chrono::seconds(30), GroupOptions(), "auto+cuda"));
  const auto text = read_file(path);
  EXPECT_EQ(count(text, "\"op\": \"all_reduce\""), 6u) << text;
  EXPECT_EQ(count(text, "\"seq\": 0, \"op\": \"all_reduce\", \"kind\": \"collective\", \"dtype\": \"Double\""), 2u)
      << text;
}

TEST(FlightRecorder, TheRingKeepsTheLast2000Operations) {
  TempDir dir;
  std::string path;
  testing::expect_no_errors(testing::run_ranks(1, [&](ProcessGroup& g) {
    for (int i = 0; i < 2100; ++i) g.all_reduce(at::ones({1}))->wait();
    path = dump_flight_recorder(dir.path);
  }));
  const auto text = read_file(path);
  EXPECT_EQ(count(text, "\"seq\": "), 2000u);
  EXPECT_FALSE(Contains(text, "\"seq\": 99,"));
  EXPECT_TRUE(Contains(text, "\"seq\": 100,"));
  EXPECT_TRUE(Contains(text, "\"seq\": 2099,"));
}

TEST(FlightRecorder, DumpWithoutADirectoryIsNamed) {
  ASSERT_EQ(getenv("DTRAIN_TRACE_DIR"), nullptr);
  EXPECT_TRUE(Contains(testing::what_thrown<InvalidArgument>([] { dump_flight_recorder(); }),
                       "dump_flight_recorder: no directory given and DTRAIN_TRACE_DIR is not set"));
}

}  // namespace
}  // namespace dtrain
