// Fault tolerance (dtrain/ft/manager.h): replicas of thread ranks around an
// in-process lighthouse. The processes killed with signals are in
// process_test (FaultToleranceProcesses).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <dirent.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/ft_replicas.h"
#include "harness/scoped_env.h"
#include "harness/thread_ranks.h"
#include "harness/training.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;

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
  std::vector<int64_t> committed(4, 0);
  run_two_replicas_of_two(lighthouse, [&](int t, std::shared_ptr<ProcessGroup> inner, ft::ManagerOptions options) {
    auto net = ft_nets[t];
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
    checkpoint::DistributedState state;
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, opt, *net);
    ft::Manager manager(state, options);
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

TEST(FaultTolerance, AReplicaThatDiesMidStepIsDroppedAndItsReturnHealsItBitwiseFromALivePeer) {
  constexpr int64_t kDieAt = 20, kCap = 3000, kAfterReturn = 10;  // (the cap: survivors outlast c's 1 s away)
  const auto data = make_data<MLPImpl>(3 * 4, kCap + 1);
  std::vector<std::shared_ptr<MLPImpl>> nets{make_model<MLPImpl>(0), make_model<MLPImpl>(0),
                                             make_model<MLPImpl>(0), make_model<MLPImpl>(7)};
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).heartbeat_timeout(500ms));
  CommitLog log;
  std::atomic<int> uncommitted{0};
  std::atomic<int64_t> returned_commits{0}, first_return_step{-1};
  const std::vector<std::string> ids{"a", "b", "c"};
  StartLine all_started(3);

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
    if (name != "c-returned") all_started.arrive_and_wait();
    while (!done(manager.current_step())) {
      manager.start_quorum();
      const auto& b = data[manager.current_step()];
      opt.zero_grad();
      torch::mse_loss(net->forward(b.x.narrow(0, replica * 4, 4)), b.y.narrow(0, replica * 4, 4)).backward();
      if (die_at >= 0 && manager.current_step() >= die_at) {  // (>=: it may have healed past it)
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
  // The survivors committed every step through c's death and return. (Not
  // always the last ones: when one stops, its group's last vote may fail
  // on the other, which then heals.)
  for (const char* id : {"a", "b"}) {
    int64_t first = 0;
    for (const auto& [step, by_replica] : log.after)
      if (by_replica.count(id) && first == 0) first = step;
    EXPECT_LT(first, kDieAt) << id;
    for (int64_t step = first; step <= first_return_step.load(); ++step)
      EXPECT_TRUE(log.after.count(step) && log.after.at(step).count(id)) << id << " did not commit step " << step;
  }
  EXPECT_EQ(returned_commits.load(), kAfterReturn);
  EXPECT_GT(first_return_step.load(), kDieAt + 1) << "c came back at step 0 and took the survivors' step";
  int64_t first_life_last = 0;
  for (const auto& [step, by_replica] : log.after)
    if (by_replica.count("c")) first_life_last = step;
  EXPECT_GE(first_life_last, kDieAt) << "c's first life committed up to the step it died in";
  EXPECT_LT(first_life_last, first_return_step.load());
  EXPECT_GE(uncommitted.load(), 1) << "the step c died in did not commit";
  EXPECT_GE(compared, 2 * (last - 1) + kDieAt + kAfterReturn);
}

// Two histories at one step: replica a commits step 1 in a quorum of its
// own; b, whose quorum gave up waiting for a (the join timeout: a's step
// is long), commits step 1 in another, from other initial values. When
// they meet, both at step 1, b must take a's state (the lineages tie: the
// first member's wins). Before, members at one step were taken as equal
// and the two trained on apart, every commit a different state (seen in
// CI when a busy machine had a replica declared dead at its start).
TEST(FaultTolerance, ReplicasWhoseHistoriesForkedAtOneStepAreMadeOneWhenTheyMeet) {
  constexpr int kTogether = 5;
  const auto data = make_data<MLPImpl>(2 * 4, 64);
  std::vector<std::shared_ptr<MLPImpl>> nets{make_model<MLPImpl>(0), make_model<MLPImpl>(7)};
  // The join timeout lets b's quorum form without a (a is held in its
  // step); at the meeting a asks first and b 1 s later, well within it, so
  // that the quorum holds both (b first would take the fast path of its
  // own quorum of one; seen on a busy machine with 300 ms and no pause).
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).heartbeat_timeout(5s).tick(10ms).join_timeout(3s));
  std::mutex mutex;
  std::condition_variable cv;
  int solo_commits = 0;  // a's, then b's
  std::vector<bool> healed(2, false);
  run_threads(2, [&](int replica) {
    auto wait_for = [&](int n) {
      std::unique_lock<std::mutex> lock(mutex);
      ASSERT_TRUE(cv.wait_for(lock, 30s, [&] { return solo_commits >= n; }));
    };
    if (replica == 1) wait_for(1);  // b starts once a has committed alone
    auto net = nets[replica];
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
    checkpoint::DistributedState state;
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, opt, *net);
    ft::Manager manager(state, ft::ManagerOptions()
                                   .lighthouse(lighthouse.address())
                                   .replica_id(replica == 0 ? "a" : "b")
                                   .heartbeat_interval(50ms)
                                   .timeout(10s)
                                   .quorum_timeout(30s)
                                   .async_quorum(false));
    int together = 0;
    while (together < kTogether) {
      manager.start_quorum();
      const auto q = manager.quorum();
      const auto& b = data[manager.current_step()];
      opt.zero_grad();
      torch::mse_loss(net->forward(b.x.narrow(0, replica * 4, 4)), b.y.narrow(0, replica * 4, 4)).backward();
      for (auto& p : net->parameters()) manager.allreduce(p.mutable_grad());
      ASSERT_TRUE(manager.should_commit()) << "step " << manager.current_step();
      opt.step();
      healed[replica] = healed[replica] || q.healing;
      if (q.members.size() == 2) {
        ++together;
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(mutex);
        ++solo_commits;
      }
      cv.notify_all();
      ASSERT_EQ(manager.current_step(), 1) << "each commits step 1 alone, then they meet";
      wait_for(2);  // a waits for b's commit alone, then asks at once
      if (replica == 1) std::this_thread::sleep_for(1s);
    }
  });
  EXPECT_EQ(solo_commits, 2) << "the histories forked";
  EXPECT_TRUE(healed[1]) << "b took a's state";
  EXPECT_FALSE(healed[0]);
  EXPECT_TRUE(torch::equal(flat_parameters(*nets[0]), flat_parameters(*nets[1])))
      << "the replicas differ by " << (flat_parameters(*nets[0]) - flat_parameters(*nets[1])).abs().max().item<double>();
}

TEST(FaultTolerance, BadInputIsRefusedByNameAndTheJobGoesOn) {
  auto net = make_model<MLPImpl>(0);
  checkpoint::DistributedState state;
  checkpoint::add_module(state, *net);
  const int port = [] {
    TcpStore probe(TcpStoreOptions().port(0).is_server(true).wait_workers(false));
    return probe.port();
  }();
  EXPECT_NE(what_thrown<Error>([&] {
              ft::Manager m(state, ft::ManagerOptions()
                                       .lighthouse("127.0.0.1:" + std::to_string(port))
                                       .replica_id("a")
                                       .connect_timeout(500ms));
            }).find("the lighthouse at 127.0.0.1:" + std::to_string(port) + " is unreachable"),
            std::string::npos);
  EXPECT_NE(what_thrown<Error>([&] { ft::Manager m(state, ft::ManagerOptions().lighthouse("127.0.0.1:1")); })
                .find("no replica id (set ManagerOptions::replica_id or DTRAIN_FT_REPLICA_ID)"),
            std::string::npos);
  EXPECT_NE(what_thrown<Error>([&] { ft::Manager m(state, ft::ManagerOptions().lighthouse("nowhere").replica_id("a")); })
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
  const std::string e = what_thrown<Error>([&] { b.start_quorum(); });
  EXPECT_NE(e.find("ft::Manager (replica 'b', rank 0/1): the lighthouse refused this replica: replica 'b' has 1 "
                   "ranks and state fingerprint"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("another model or optimizer layout"), std::string::npos) << e;
  a.start_quorum();
  EXPECT_TRUE(a.should_commit()) << "a goes on";
  EXPECT_EQ(a.current_step(), 2);
}

// step_samples under a synchronous quorum: a replica dies mid-step (its
// share trained, its gradients never sent) and comes back; every block of
// samples is trained in exactly one committed step, cut among the step's
// members without gap or overlap.
TEST(FaultTolerance, EachSampleIsTrainedInExactlyOneCommittedStepAcrossADeathAndAReturn) {
  constexpr int64_t kDieAt = 15, kPerRank = 3, kAfterReturn = 10;
  std::vector<std::shared_ptr<MLPImpl>> nets{make_model<MLPImpl>(0), make_model<MLPImpl>(1),
                                             make_model<MLPImpl>(2), make_model<MLPImpl>(3)};
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).heartbeat_timeout(500ms));
  struct Slice {
    int64_t first, count, step_first, step_count;
  };
  std::mutex mutex;
  std::map<int64_t, std::map<std::string, Slice>> committed;  // step -> replica -> its samples
  std::map<int64_t, std::map<std::string, at::Tensor>> params;
  std::atomic<int> returned_commits{0};
  const std::vector<std::string> ids{"a", "b", "c"};
  StartLine all_started(3);
  auto life = [&](int replica, const std::string& name, std::shared_ptr<MLPImpl> net, int64_t die_at,
                  const std::function<bool()>& done) {
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
    checkpoint::DistributedState state;
    checkpoint::add_module(state, *net);
    ft::Manager m(state, ft::ManagerOptions()
                             .lighthouse(lighthouse.address())
                             .replica_id(ids[replica])
                             .async_quorum(false)
                             .heartbeat_interval(50ms)
                             .timeout(10s));
    if (die_at >= 0 || replica < 2) all_started.arrive_and_wait();
    while (!done() && m.current_step() < 30000) {  // (a cap, should c never come back)
      m.start_quorum();
      const auto s = m.step_samples(kPerRank);
      auto x = torch::arange(s.first, s.first + s.count, torch::kFloat).unsqueeze(1).expand({s.count, 10}) / 1000;
      opt.zero_grad();
      net->forward(x).pow(2).mean().backward();
      if (die_at >= 0 && m.current_step() >= die_at) return;  // dies with its gradients unsent
      for (auto& p : net->parameters()) m.allreduce(p.mutable_grad());
      if (!m.should_commit()) continue;
      opt.step();
      std::lock_guard<std::mutex> lock(mutex);
      committed[m.current_step()][name] = Slice{s.first, s.count, s.step_first, s.step_count};
      params[m.current_step()][name] = flat_parameters(*net);
      if (die_at < 0 && replica == 2) ++returned_commits;
    }
  };
  run_threads(3, [&](int replica) {
    auto back = [&] { return returned_commits >= kAfterReturn; };
    if (replica < 2) return life(replica, ids[replica], nets[replica], -1, back);
    life(2, "c", nets[2], kDieAt, [] { return false; });
    std::this_thread::sleep_for(800ms);
    life(2, "c-returned", nets[3], -1, back);
  });

  int64_t next = 0;
  for (const auto& [step, slices] : committed) {
    const auto& any = slices.begin()->second;
    EXPECT_EQ(any.step_first, next) << "step " << step << " starts where the committed ones end";
    std::vector<std::pair<int64_t, int64_t>> parts;
    for (const auto& [id, s] : slices) {
      EXPECT_EQ(s.step_first, any.step_first) << "step " << step << ", " << id;
      EXPECT_EQ(s.step_count, any.step_count) << "step " << step << ", " << id;
      parts.emplace_back(s.first, s.count);
    }
    std::sort(parts.begin(), parts.end());
    int64_t at = any.step_first;
    for (const auto& [first, count] : parts) {
      EXPECT_EQ(first, at) << "step " << step << ": a gap or an overlap";
      at = first + count;
    }
    EXPECT_EQ(at, any.step_first + any.step_count) << "step " << step << ": every member's share committed";
    next = any.step_first + any.step_count;
    for (const auto& [id, p] : params.at(step))
      EXPECT_TRUE(torch::equal(p, params.at(step).begin()->second)) << "step " << step << ", " << id;
  }
  // (The first steps may have fewer members, as the replicas start apart,
  // and so may the last, as they stop apart.)
  int64_t shrank_at = 0, grew_at = 0;
  for (const auto& [step, slices] : committed) {
    const int64_t n = slices.begin()->second.step_count;
    if (n == 2 * kPerRank && step > kDieAt && shrank_at == 0) shrank_at = step;
    if (n == 3 * kPerRank && shrank_at > 0 && grew_at == 0) grew_at = step;
  }
  EXPECT_GT(shrank_at, 0) << "while c was away the steps had two members";
  EXPECT_GT(grew_at, shrank_at) << "and three again once it was back";
}

int64_t open_files() {  // (no std::filesystem: libtorch 2.x exports its own)
  int64_t n = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (dir && readdir(dir)) ++n;
  if (dir) closedir(dir);
  return n;
}

int64_t resident_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

// Every step that does not commit gives the next quorum a new id, and so
// new cross-replica groups: a thousand of them in a row must leave no file
// descriptor and no memory behind.
TEST(FaultTolerance, AThousandGroupRebuildsLeaveFileDescriptorsAndMemoryAsTheyWere) {
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).min_replicas(2).tick(1ms));
  auto net_a = make_model<MLPImpl>(0), net_b = make_model<MLPImpl>(0);
  checkpoint::DistributedState state_a, state_b;
  checkpoint::add_module(state_a, *net_a);
  checkpoint::add_module(state_b, *net_b);
  constexpr int kWarmUp = 50, kCycles = 1000;
  std::atomic<int64_t> fds_before{0}, rss_before{0}, fds_after{0}, rss_after{0};
  std::array<std::atomic<int>, 2> arrived{};
  std::set<std::string> ids;
  std::mutex ids_mutex;
  run_threads(2, [&](int t) {
    ft::Manager m(t == 0 ? state_a : state_b, ft::ManagerOptions()
                                                  .lighthouse(lighthouse.address())
                                                  .replica_id(t == 0 ? "a" : "b")
                                                  .init_sync(false)
                                                  .timeout(20s));
    auto grad = torch::ones({1024});
    for (int i = 0; i < kWarmUp + kCycles; ++i) {
      if (i == kWarmUp || i == kWarmUp + kCycles - 1) {  // both threads between steps: measure
        auto& gate = arrived[i == kWarmUp ? 0 : 1];
        ++gate;
        while (gate < 2) std::this_thread::yield();
        if (t == 0) {
          (i == kWarmUp ? fds_before : fds_after) = open_files();
          (i == kWarmUp ? rss_before : rss_after) = resident_bytes();
        }
        ++gate;
        while (gate < 4) std::this_thread::yield();
      }
      m.start_quorum();
      m.allreduce(grad);
      if (t == 0) m.report_error(std::make_exception_ptr(Error("a step that fails on purpose")));
      EXPECT_FALSE(m.should_commit());
      std::lock_guard<std::mutex> lock(ids_mutex);
      ids.insert(m.quorum().id);
    }
  });
  EXPECT_GE(ids.size(), static_cast<size_t>(kWarmUp + kCycles - 1)) << "a new quorum, and new groups, every step";
  EXPECT_EQ(fds_after.load(), fds_before.load()) << "file descriptors";
  EXPECT_LE(rss_after.load() - rss_before.load(), 1 << 20)
      << "resident memory grew by " << (rss_after.load() - rss_before.load()) << " bytes";
}

}  // namespace
}  // namespace dtrain::testing
