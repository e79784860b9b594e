// Bad arguments fail before any communication; silent peers become
// TimeoutError within the timeout; DTRAIN_DEBUG=DETAIL names mismatches.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <future>

#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::expect_no_errors;
using testing::run_ranks;

// Expects `fn` to throw E whose message contains `needle`.
template <typename E, typename F>
void expect_throw(F&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an exception containing: " << needle;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

TEST(ArgumentErrors, RejectedOnOneRankWithoutCommunicating) {
  // Only rank 0 makes the bad calls; if any of them started communicating it
  // would block until the 60 s timeout instead of throwing at once.
  auto start = std::chrono::steady_clock::now();
  expect_no_errors(run_ranks(2, [](ProcessGroup& g) {
    if (g.rank() != 0) return;
    auto f = at::ones({4});
    expect_throw<InvalidArgument>([&] { g.broadcast(f, 2); }, "root rank 2 is out of range");
    expect_throw<InvalidArgument>([&] { g.reduce(f, -1); }, "root rank -1 is out of range");
    expect_throw<InvalidArgument>([&] { g.all_gather({}, f); }, "outputs has 0 tensors; expected 2");
    expect_throw<InvalidArgument>([&] { g.all_gather({at::ones({4}), at::ones({4}, at::kInt)}, f); },
                                  "outputs[1] has dtype Int but expected Float");
    expect_throw<InvalidArgument>([&] { g.all_gather({at::ones({4}), at::ones({5})}, f); },
                                  "outputs[1] has 5 elements");
    expect_throw<InvalidArgument>([&] { g.gather({at::ones({4})}, f, 1); },
                                  "outputs must be empty on non-root rank 0");
    expect_throw<InvalidArgument>([&] { g.scatter(f, {f}, 0); }, "inputs has 1 tensors; expected 2");
    expect_throw<InvalidArgument>([&] { g.reduce_scatter(f, {f, at::ones({3})}); },
                                  "inputs[1] has 3 elements");
    expect_throw<InvalidArgument>([&] { g.all_to_all({f, f}, {f, at::ones({4}, at::kLong)}); },
                                  "inputs[1] has dtype Long but inputs[0] has Float");
    expect_throw<InvalidArgument>([&] { g.all_reduce(at::ones({4}, at::kBool)); },
                                  "has dtype Bool");
    expect_throw<InvalidArgument>([&] { g.all_reduce(at::Tensor()); }, "undefined tensor");
    expect_throw<InvalidArgument>([&] { g.all_reduce(at::ones({2, 2}).to_sparse()); },
                                  "only dense (strided) tensors are supported");
    expect_throw<InvalidArgument>([&] { g.send(f, 0); }, "rank 0 is this rank");
    expect_throw<InvalidArgument>([&] { g.recv(f, 5); }, "src rank 5 is out of range");
    expect_throw<InvalidArgument>([&] { g.send(f, 1, -3); }, "tag must be >= 0");
    expect_throw<InvalidArgument>([&] { g.all_reduce(f, ReduceOp::SUM, 0ms); },
                                  "timeout must be positive");
  }, 60s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
}

TEST(BackendRegistry, MissingBackendsExplainThemselves) {
  auto store = std::make_shared<HashStore>();
  // CI builds with MPI (scripts/setup.sh installs libopenmpi-dev), and the
  // nccl plug-in loads only when nccl is asked for.
  EXPECT_EQ(available_backends(), (std::vector<std::string>{"auto", "gloo", "mpi", "shm", "tcp"}));
#ifdef DTRAIN_TEST_NCCL_PLUGIN
  // Built (CUDA 13 and NCCL are on the machines): without a GPU the plug-in
  // loads, registers itself, and the group says why it cannot run.
  if (!torch::cuda::is_available()) {
    expect_throw<BackendUnavailable>([&] { create_process_group("nccl", store, 0, 1); },
                                     "nccl: no usable CUDA device: cudaGetDeviceCount: ");
    EXPECT_EQ(available_backends(),
              (std::vector<std::string>{"auto", "gloo", "mpi", "nccl", "shm", "tcp"}));
  }
#else
  expect_throw<BackendUnavailable>([&] { create_process_group("nccl", store, 0, 1); },
                                   "nccl: dtrain was built without the nccl backend");
#endif
  expect_throw<BackendUnavailable>(
      [&] { create_process_group("carrier-pigeon", store, 0, 1); },
      "unknown backend 'carrier-pigeon'; available backends: auto, gloo, mpi, ");
}

TEST(Timeouts, SilentPeerBecomesTimeoutErrorWithinTheTimeout) {
  // Rank 1 joins the group, then goes silent until rank 0 has given up.
  std::mutex m;
  std::condition_variable cv;
  bool rank0_done = false;
  const auto timeout = 1500ms;
  std::chrono::steady_clock::duration elapsed{};
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    if (g.rank() == 1) {
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return rank0_done; });
      return;
    }
    auto start = std::chrono::steady_clock::now();
    try {
      g.all_reduce(at::ones({1000}))->wait();
      ADD_FAILURE() << "all_reduce with a silent peer returned";
    } catch (const TimeoutError& e) {
      elapsed = std::chrono::steady_clock::now() - start;
      EXPECT_NE(std::string(e.what()).find("all_reduce #0 on group 'default'"), std::string::npos)
          << e.what();
    }
    {
      std::lock_guard<std::mutex> lock(m);
      rank0_done = true;
    }
    cv.notify_all();
  }, timeout);
  expect_no_errors(errors);
  EXPECT_GE(elapsed, timeout / 2);
  EXPECT_LE(elapsed, timeout * 2);
}

TEST(Timeouts, WorkWaitTimeoutIsSeparateFromTheOperation) {
  std::mutex m;
  std::condition_variable cv;
  bool release = false;
  expect_no_errors(run_ranks(2, [&](ProcessGroup& g) {
    if (g.rank() == 1) {
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return release; });
      g.barrier()->wait();
      return;
    }
    auto work = g.barrier();
    expect_throw<TimeoutError>([&] { work->wait(100ms); }, "did not complete within 100 ms");
    EXPECT_FALSE(work->is_completed());
    {
      std::lock_guard<std::mutex> lock(m);
      release = true;
    }
    cv.notify_all();
    work->wait();  // the barrier itself still completes
    EXPECT_TRUE(work->is_success());
    EXPECT_EQ(work->exception(), nullptr);
  }, 20s));
}

TEST(DebugDetail, MismatchedCollectivesRaiseOnEveryRank) {
  auto errors = run_ranks(2, [](ProcessGroup& g) {
    auto t = at::ones({4, 4});
    if (g.rank() == 0) {
      g.all_reduce(t)->wait();
    } else {
      g.broadcast(t, 0)->wait();
    }
  }, 20s, GroupOptions().check_collectives(true));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("called different collectives at call #0"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("rank 0: all_reduce #0 (dtype Float, shape [4, 4], op SUM)"),
              std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 1: broadcast #0 (dtype Float, shape [4, 4], root 0)"),
              std::string::npos) << errors[r];
  }
}

TEST(DebugDetail, MismatchedShapesAreNamed) {
  auto errors = run_ranks(3, [](ProcessGroup& g) {
    g.all_reduce(at::ones({4}))->wait();  // matching call passes the check
    g.all_reduce(at::ones({g.rank() == 2 ? 5 : 4}, at::kDouble))->wait();
  }, 20s, GroupOptions().check_collectives(true));
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("rank 2: all_reduce #1 (dtype Double, shape [5], op SUM)"),
              std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

}  // namespace
}  // namespace dtrain

namespace dtrain {
namespace {

// A backend's factory may ask the world about itself (is_initialized,
// get_rank): init_process_group and new_group run factories outside the
// world's lock. Before, both calls deadlocked.
TEST(BackendRegistry, FactoriesMayQueryTheWorld) {
  std::atomic<int> calls{0};
  register_backend("introspective", [&](std::shared_ptr<Store> store, int rank, int size,
                                        const GroupOptions& options) {
    if (is_initialized()) EXPECT_EQ(get_rank(), 0);
    ++calls;
    return create_process_group("tcp", std::move(store), rank, size, options);
  });
  auto run = std::async(std::launch::async, [] {
    init_process_group(InitOptions()
                           .backend("introspective")
                           .store(std::make_shared<HashStore>())
                           .rank(0)
                           .world_size(1));
    auto sub = new_group({0});
    auto t = at::ones({2});
    sub->all_reduce(t)->wait();
    destroy_process_group();
  });
  if (run.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "init_process_group or new_group deadlocked in a backend factory";
    std::_Exit(1);
  }
  run.get();
  EXPECT_EQ(calls.load(), 2);
}

}  // namespace
}  // namespace dtrain
