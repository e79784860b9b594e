#pragma once

// Runs one function per rank, each rank a thread of this process, over an
// in-memory store (gloo's base_test.h pattern): fast, the default harness.
// Any exception on any rank fails the test with the rank's number; a rank
// that cannot build its group fails too — never a skip.

#include <gtest/gtest.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/dtrain.h"

namespace dtrain::shm {
void set_thread_host_id(const std::string& id);  // transport/shm/node.h
}
namespace dtrain::device_routing {
void set_thread_routing_forced(bool forced);  // backends/auto/device_routing.h
}

namespace dtrain::testing {

// create_process_group, and two more backend names: "auto@H" is backend
// auto with this process's thread ranks spread over H stand-in hosts (rank r
// on host r*H/world), which share no memory: shared-memory rings inside a
// host, TCP across. "auto+cuda" is auto as a CUDA-enabled libtorch builds
// it: its group wrapped in the layer that routes CUDA tensors. Call it on
// the rank's own thread.
inline std::shared_ptr<ProcessGroup> create_test_group(const std::string& backend,
                                                       std::shared_ptr<Store> store, int rank,
                                                       int world, const GroupOptions& options) {
  if (backend == "auto+cuda") {
    device_routing::set_thread_routing_forced(true);
    auto g = create_process_group("auto", store, rank, world, options);
    device_routing::set_thread_routing_forced(false);
    return g;
  }
  const auto at = backend.find('@');
  if (at == std::string::npos) return create_process_group(backend, store, rank, world, options);
  const int hosts = std::stoi(backend.substr(at + 1));
  shm::set_thread_host_id("test-host-" + std::to_string(rank * hosts / world));
  return create_process_group(backend.substr(0, at), store, rank, world, options);
}

// What each rank's body gets: its group over all ranks and the shared
// store (to build subgroups with create_process_group).
struct RankContext {
  std::shared_ptr<ProcessGroup> group;
  std::shared_ptr<Store> store;
  int rank;
  int world;
};

inline std::vector<std::string> run_rank_contexts(
    int world, const std::function<void(RankContext&)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(30),
    GroupOptions options = GroupOptions(), const std::string& backend = "tcp") {
  auto store = std::make_shared<HashStore>(timeout);
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        RankContext ctx{create_test_group(backend, store, rank, world,
                                          GroupOptions(options).timeout(timeout)),
                        store, rank, world};
        body(ctx);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline std::vector<std::string> run_ranks(
    int world, const std::function<void(ProcessGroup&)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(30),
    GroupOptions options = GroupOptions(), const std::string& backend = "tcp") {
  return run_rank_contexts(world, [&](RankContext& ctx) { body(*ctx.group); }, timeout, options,
                           backend);
}

// Mesh options for a thread rank: the mesh's groups are `backend` groups
// (create_test_group) on the test's store, named by their ranks, with the
// rank's group's timeout.
inline DeviceMeshOptions thread_mesh(RankContext& ctx, const std::string& backend = "tcp") {
  return DeviceMeshOptions().group(ctx.group).new_group([&ctx, backend](const std::vector<int>& ranks) {
    std::string name = "mesh";
    for (int r : ranks) name += "-" + std::to_string(r);
    const auto at = std::find(ranks.begin(), ranks.end(), ctx.rank);
    const int me = static_cast<int>(at - ranks.begin());
    return create_test_group(backend, std::make_shared<PrefixStore>(name, ctx.store), me,
                             static_cast<int>(ranks.size()),
                             GroupOptions().name(name).global_ranks(ranks).timeout(ctx.group->timeout()));
  });
}

// Fails the current test when any rank threw.
inline void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r)
    EXPECT_TRUE(errors[r].empty()) << "rank " << r << " threw: " << errors[r];
}

}  // namespace dtrain::testing
