// Fault tolerance (dtrain/ft/manager.h): replicas of thread ranks around an
// in-process lighthouse. The processes killed with signals are in
// process_test (FaultToleranceProcesses).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <thread>

#include "dtrain/dtrain.h"
#include "harness/scoped_env.h"
#include "harness/thread_ranks.h"
#include "harness/training.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;

at::Tensor flat_parameters(torch::nn::Module& m) {
  std::vector<at::Tensor> ps;
  for (auto& p : m.parameters()) ps.push_back(p.detach().flatten());
  return torch::cat(ps).clone();
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// Threads, each its own body; the first exception of each fails the test.
void run_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      try {
        body(t);
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int t = 0; t < n; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
}

TEST(FaultTolerance, TwoReplicasOfTwoRanksUnderFtDdpEqualFourRankDdpBitwiseOver200Steps) {
  // Both sides sum in the same order: recursive doubling over four ranks
  // adds rank pairs (0,1) and (2,3) first, as the replicas do inside.
  ScopedEnv algo("DTRAIN_ALGO", "recursive_doubling");
  constexpr int kSteps = 200, kRows = 4;
  const auto data = make_data<MLPImpl>(4 * kRows, kSteps);
  std::vector<std::shared_ptr<MLPImpl>> ref_nets, ft_nets;
  for (int r = 0; r < 4; ++r) ref_nets.push_back(make_model<MLPImpl>(0));
  for (int r = 0; r < 4; ++r) ft_nets.push_back(make_model<MLPImpl>(0));
  auto rows = [&](const torch::Tensor& t, int rank) { return t.narrow(0, rank * kRows, kRows); };

  auto errors = run_rank_contexts(4, [&](RankContext& ctx) {
    DistributedDataParallel ddp(ref_nets[ctx.rank], DDPOptions().process_group(ctx.group));
    torch::optim::Adam opt(ddp.parameters(), torch::optim::AdamOptions(1e-2));
    for (const auto& b : data) {
      opt.zero_grad();
      torch::mse_loss(ddp.forward(rows(b.x, ctx.rank)), rows(b.y, ctx.rank)).backward();
      opt.step();
    }
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");

  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).min_replicas(2));
  std::vector<std::shared_ptr<Store>> replica_stores{std::make_shared<HashStore>(30s),
                                                     std::make_shared<HashStore>(30s)};
  std::vector<int64_t> committed(4, 0);
  run_threads(4, [&](int t) {
    const int replica = t / 2, local = t % 2;
    auto inner = create_process_group("tcp", replica_stores[replica], local, 2,
                                      GroupOptions().name("replica").timeout(30s));
    auto net = ft_nets[t];
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
    checkpoint::DistributedState state;
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, opt, *net);
    ft::Manager manager(state, ft::ManagerOptions()
                                   .lighthouse(lighthouse.address())
                                   .replica_id(replica == 0 ? "a" : "b")
                                   .group(inner)
                                   .store(replica_stores[replica])
                                   .min_replicas(2)
                                   .init_sync(false)  // the same seed: no step-0 heal, every gradient counts
                                   .timeout(30s));
    DistributedDataParallel ddp(net, DDPOptions().process_group(inner));
    ddp.register_comm_hook(ft::allreduce_hook(manager));
    for (const auto& b : data) {
      manager.start_quorum();
      opt.zero_grad();
      torch::mse_loss(ddp.forward(rows(b.x, t)), rows(b.y, t)).backward();
      if (manager.should_commit()) opt.step();
    }
    committed[t] = manager.current_step();
  });
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(committed[t], kSteps) << "rank " << t << ": every step commits without failures";
    EXPECT_TRUE(torch::equal(flat_parameters(*ft_nets[t]), flat_parameters(*ref_nets[t])))
        << "rank " << t << " differs from 4-rank DDP by "
        << (flat_parameters(*ft_nets[t]) - flat_parameters(*ref_nets[t])).abs().max().item<double>();
  }
}

// What each replica's parameters were after each step it committed.
struct CommitLog {
  std::mutex mutex;
  std::map<int64_t, std::map<std::string, at::Tensor>> after;
  void record(int64_t step, const std::string& replica, const at::Tensor& params) {
    std::lock_guard<std::mutex> lock(mutex);
    after[step][replica] = params;
  }
};

TEST(FaultTolerance, AReplicaThatDiesMidStepIsDroppedAndItsReturnHealsItBitwiseFromALivePeer) {
  constexpr int64_t kDieAt = 20, kCap = 400, kAfterReturn = 10;
  const auto data = make_data<MLPImpl>(3 * 4, kCap + 1);
  std::vector<std::shared_ptr<MLPImpl>> nets{make_model<MLPImpl>(0), make_model<MLPImpl>(0),
                                             make_model<MLPImpl>(0), make_model<MLPImpl>(7)};
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).heartbeat_timeout(500ms));
  CommitLog log;
  std::atomic<int> uncommitted{0};
  std::atomic<int64_t> returned_commits{0}, first_return_step{-1};
  const std::vector<std::string> ids{"a", "b", "c"};

  // One life of a replica: trains until done() (checked after each step),
  // or (die_at) returns mid-step once that step's quorum is known.
  auto life = [&](int replica, const std::string& name, std::shared_ptr<MLPImpl> net, int64_t die_at,
                  const std::function<bool(int64_t)>& done) {
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    checkpoint::DistributedState state;
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, opt, *net);
    ft::Manager manager(state, ft::ManagerOptions()
                                   .lighthouse(lighthouse.address())
                                   .replica_id(ids[replica])
                                   .heartbeat_interval(50ms)
                                   .timeout(10s)
                                   .quorum_timeout(30s));
    while (!done(manager.current_step())) {
      manager.start_quorum();
      const auto& b = data[manager.current_step()];
      opt.zero_grad();
      torch::mse_loss(net->forward(b.x.narrow(0, replica * 4, 4)), b.y.narrow(0, replica * 4, 4)).backward();
      if (manager.current_step() == die_at) {
        manager.num_participants();  // the round is over: its peers wait for this one's gradients
        return;                      // dies: its sockets close, its heartbeats stop
      }
      for (auto& p : net->parameters()) manager.allreduce(p.mutable_grad());
      if (!manager.should_commit()) {
        ++uncommitted;
        continue;
      }
      opt.step();
      log.record(manager.current_step(), name, flat_parameters(*net));
      if (name == "c-returned") {
        int64_t none = -1;
        first_return_step.compare_exchange_strong(none, manager.current_step());
        ++returned_commits;
      }
    }
  };
  run_threads(3, [&](int replica) {
    // The survivors go on until c is back and has committed a while.
    auto survivor_done = [&](int64_t step) { return step >= kCap || returned_commits >= kAfterReturn; };
    if (replica < 2) return life(replica, ids[replica], nets[replica], -1, survivor_done);
    life(2, "c", nets[2], kDieAt, [](int64_t) { return false; });
    std::this_thread::sleep_for(1000ms);  // dead for a while
    life(2, "c-returned", nets[3], -1, [&](int64_t) { return returned_commits >= kAfterReturn; });
  });

  int64_t compared = 0;
  for (const auto& [step, by_replica] : log.after) {
    const auto& [first_id, first] = *by_replica.begin();
    for (const auto& [id, params] : by_replica) {
      EXPECT_TRUE(torch::equal(params, first)) << "step " << step << ": replica " << id << " differs from "
                                               << first_id;
      ++compared;
    }
  }
  ASSERT_FALSE(log.after.empty());
  const int64_t last = log.after.rbegin()->first;
  EXPECT_LT(last, kCap) << "c came back before the survivors' cap";
  for (const char* id : {"a", "b"}) {  // (the last step may be the other's alone: they stop apart)
    int64_t steps = 0, highest = 0;
    for (const auto& [step, by_replica] : log.after)
      if (by_replica.count(id)) ++steps, highest = step;
    EXPECT_EQ(steps, highest) << id << " survived and committed every step up to its last";
    EXPECT_GE(highest, first_return_step.load() + kAfterReturn - 2) << id;
  }
  EXPECT_EQ(returned_commits.load(), kAfterReturn);
  EXPECT_GT(first_return_step.load(), kDieAt + 1) << "c came back at step 0 and took the survivors' step";
  EXPECT_EQ(log.after.at(kDieAt).count("c"), 1u) << "c committed up to the step it died in";
  EXPECT_EQ(log.after.count(kDieAt + 1) ? log.after.at(kDieAt + 1).count("c") : 0u, 0u);
  EXPECT_GE(uncommitted.load(), 1) << "the step c died in did not commit";
  EXPECT_GE(compared, 2 * (last - 1) + kDieAt + kAfterReturn);
}

TEST(FaultTolerance, BadInputIsRefusedByNameAndTheJobGoesOn) {
  auto net = make_model<MLPImpl>(0);
  checkpoint::DistributedState state;
  checkpoint::add_module(state, *net);
  const int port = [] {
    TcpStore probe(TcpStoreOptions().port(0).is_server(true).wait_workers(false));
    return probe.port();
  }();
  EXPECT_NE(error_of([&] {
              ft::Manager m(state, ft::ManagerOptions()
                                       .lighthouse("127.0.0.1:" + std::to_string(port))
                                       .replica_id("a")
                                       .connect_timeout(500ms));
            }).find("the lighthouse at 127.0.0.1:" + std::to_string(port) + " is unreachable"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ft::Manager m(state, ft::ManagerOptions().lighthouse("127.0.0.1:1")); })
                .find("no replica id (set ManagerOptions::replica_id or DTRAIN_FT_REPLICA_ID)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ft::Manager m(state, ft::ManagerOptions().lighthouse("nowhere").replica_id("a")); })
                .find("'nowhere' is not host:port"),
            std::string::npos);

  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0));
  ft::Manager a(state, ft::ManagerOptions().lighthouse(lighthouse.address()).replica_id("a"));
  a.start_quorum();
  EXPECT_TRUE(a.should_commit());

  auto other = std::make_shared<BufferNetImpl>();  // another model
  checkpoint::DistributedState other_state;
  checkpoint::add_module(other_state, *other);
  ft::Manager b(other_state,
                ft::ManagerOptions().lighthouse(lighthouse.address()).replica_id("b").async_quorum(false));
  const std::string e = error_of([&] { b.start_quorum(); });
  EXPECT_NE(e.find("ft::Manager (replica 'b', rank 0/1): the lighthouse refused this replica: replica 'b' has 1 "
                   "ranks and state fingerprint"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("another model or optimizer layout"), std::string::npos) << e;
  a.start_quorum();
  EXPECT_TRUE(a.should_commit()) << "a goes on";
  EXPECT_EQ(a.current_step(), 2);
}

}  // namespace
}  // namespace dtrain::testing
