// One rank of a multi-process test. The tests (process_test.cpp, the
// torchrun and network-namespace scripts) start several of these with the
// worker environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...).
//
//   rank_worker collectives [INIT_METHOD [BACKEND]]
//                             init (env:// and backend auto unless given;
//                             INIT_METHOD "user-store" makes a TcpStore from
//                             MASTER_ADDR/MASTER_PORT and passes it in
//                             InitOptions().store(), as a user would),
//                             print "rank R backend NAME", check every
//                             collective on the default group and a
//                             subgroup, exit 0
//   rank_worker loop [BACKEND] init, then all_reduce forever, printing
//                             "rank R steps N" every 200 steps; on a failure
//                             print "caught <Type>: <message>" and exit 3
//   rank_worker p2p-loop [BACKEND]
//                             as loop, with send/recv around a ring of ranks
//                             (rank r sends to r+1, receives from r-1)
//   rank_worker peer-leaves|recv-from-last [BACKEND]
//                             a peer leaves, or rank 0 waits on the last
//                             rank (rank_worker.h)
//   rank_worker init          init only; on failure print "caught ..." and
//                             exit 2 (used for bad-environment tests)
//   rank_worker ddp           DDP training of a small MLP for 3 steps; prints
//                             "rank R params <checksum>" (equal on all ranks)
//   rank_worker matrix BACKEND every collective x dtype x op, checked
//                             exactly (for mpirun, where threads cannot
//                             stand in for ranks); prints "rank R matrix ok"
//   rank_worker ddp-equivalence BACKEND [wide]
//                             5 DDP steps on per-rank batches against one
//                             model trained on the combined batch on every
//                             rank; prints "rank R ddp matches ..."
//                             ("wide": 4096 hidden units, so that buckets
//                             pass 64 KiB and take bandwidth algorithms)
//   rank_worker fsdp-equivalence|fsdp-sharded-construction|zero1-equivalence|zero2-equivalence BACKEND
//                             FSDP (its model built in full, or under a
//                             ShardedConstruction from a seed per rank),
//                             DDP with ZeRO-1, or DDP with shard_gradients
//                             and ZeRO-2, against one process on the
//                             combined batch; prints "rank R fsdp|fsdp
//                             (sharded construction)|zero1|zero2 matches ..."
//   rank_worker hsdp-equivalence BACKEND
//                             HSDP over a (2, world / 2) mesh, the same check
//   rank_worker pipeline-SCHEDULE BACKEND
//                             SCHEDULE (gpipe, 1f1b, interleaved, looped-bfs,
//                             zbv) over the ranks, 5 steps, against one
//                             process; prints "rank R pipeline ... matches ..."
//   rank_worker tp-equivalence|ep-equivalence|diloco-equivalence BACKEND
//                             a norm-and-MLP block under TP with SP and
//                             activation checkpointing, or an MoE with its
//                             experts over the ranks and the rest under DDP,
//                             or DiLoCo syncing every step (outer rate 1),
//                             against one process (rank_worker_parallel.cpp);
//                             prints "rank R tp+sp+ac|ep|diloco matches ..."
//   (each of these with "cuda" after BACKEND trains on GPU LOCAL_RANK % count)
//   rank_worker page-faults [STEPS]
//                             init, then STEPS (default 40) SGD steps on
//                             64 MiB tensors; prints "faults N": the fewest
//                             minor page faults of the 5-step windows after
//                             step 10 (DTRAIN_CPU_MEMORY)
//   rank_worker fsdp-malloc   prints "mapped A B": the bytes of a 48 MiB
//                             block malloc mapped on its own before and
//                             after building an FSDP (DTRAIN_CPU_MEMORY)
//   rank_worker trace BACKEND FAULT
//                             5 all_reduces and a barrier with one fault:
//                             stop (rank 1 SIGSTOPs itself before #3), exit
//                             (rank 1 exits before #3), skip (rank 1 skips
//                             #2), shape (rank 2's #3 has 5 elements, not 4),
//                             exit-idle (rank 1 exits before #3, the others
//                             sleep 30 s there), slow (rank 1 sleeps 30 s
//                             before #3), idle (every rank sleeps 30 s
//                             before #3);
//                             prints "rank R fault at <epoch ms>" before #3
//                             (for DTRAIN_TRACE_DIR tests)
//   rank_worker trace-uncaught
//                             5 all_reduces (backend auto); rank 2 skips the
//                             last (#4) and computes for 60 s; the others'
//                             TimeoutError escapes main (std::terminate)
//   rank_worker timeline      6 DDP steps (small buckets), the optimizer step
//                             a TimelineSpan; prints "rank R comm_ms X", the
//                             sum of DDPStats::communication_ms
//   rank_worker mismatch      even ranks all_reduce, odd ranks broadcast:
//                             under DTRAIN_DEBUG=DETAIL every rank exits 3
//                             with "caught CollectiveMismatch: ..."

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <thread>

#include "dtrain/dtrain.h"
#include "integration/rank_worker.h"

namespace {

// Every collective, from roots on every machine, checked exactly.
int check_every_collective(int rank, int world) {
  auto x = at::full({300}, rank + 1, at::kInt);
  dtrain::all_reduce(x, dtrain::AllReduceOptions().op(dtrain::ReduceOp::AVG));
  if (!at::equal(x, at::full({300}, (world + 1) / 2, at::kInt))) return fail("all_reduce AVG");
  auto m = at::full({7}, double(rank), at::kDouble);
  dtrain::all_reduce(m, dtrain::AllReduceOptions().op(dtrain::ReduceOp::MAX));
  if (!at::equal(m, at::full({7}, double(world - 1), at::kDouble))) return fail("all_reduce MAX");
  for (int root = 0; root < world; ++root) {
    auto b = at::full({33}, rank == root ? 100 + root : -1, at::kFloat);
    dtrain::broadcast(b, root);
    if (!at::equal(b, at::full({33}, 100 + root, at::kFloat))) return fail("broadcast from each root");
    auto r = at::full({5}, rank + 1, at::kLong);
    dtrain::reduce(r, root);
    auto want = rank == root ? at::full({5}, world * (world + 1) / 2, at::kLong)
                             : at::full({5}, rank + 1, at::kLong);
    if (!at::equal(r, want)) return fail("reduce to each root");
  }
  std::vector<at::Tensor> parts;
  for (int j = 0; j < world; ++j) parts.push_back(at::full({4}, 10 * rank + j, at::kLong));
  auto mine = at::empty({4}, at::kLong);
  dtrain::reduce_scatter(mine, parts);
  if (!at::equal(mine, at::full({4}, 10 * world * (world - 1) / 2 + world * rank, at::kLong)))
    return fail("reduce_scatter");
  std::vector<at::Tensor> got;
  for (int j = 0; j < world; ++j) got.push_back(at::empty({4}, at::kLong));
  dtrain::all_to_all(got, parts);
  for (int j = 0; j < world; ++j)
    if (!at::equal(got[j], at::full({4}, 10 * j + rank, at::kLong))) return fail("all_to_all");
  if (world == 1) return 0;  // no peer for point to point
  const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  auto incoming = at::empty({9}, at::kFloat);
  auto recv = dtrain::irecv(incoming, prev);
  dtrain::send(at::full({9}, rank, at::kFloat), next);
  recv->wait();
  if (!at::equal(incoming, at::full({9}, prev, at::kFloat))) return fail("send/recv ring");
  return 0;
}

at::Tensor pattern(int seed, int64_t n, at::ScalarType dt) {
  return (at::fmod(at::arange(n, at::kDouble) + seed, 3) + 1).to(dt);
}

// Rank 0 takes one message from every other rank, from any rank: recv
// names each sender once, and the message is that sender's.
int check_recv_from_any_rank(int rank, int world) {
  if (rank != 0) {
    dtrain::send(at::full({5}, rank, at::kInt), 0, dtrain::P2POptions().tag(4));
    return 0;
  }
  std::vector<int> senders;
  for (int i = 1; i < world; ++i) {
    auto in = at::zeros({5}, at::kInt);
    const int from = dtrain::recv(in, dtrain::kAnySource, dtrain::P2POptions().tag(4));
    if (!at::equal(in, at::full({5}, from, at::kInt))) return fail("recv from any rank: data");
    senders.push_back(from);
  }
  std::sort(senders.begin(), senders.end());
  for (int i = 1; i < world; ++i)
    if (senders[i - 1] != i) return fail("recv from any rank: senders");
  std::cout << "rank 0 received from any rank " << world - 1 << " times" << std::endl;
  return 0;
}

// new_subgroups of 1 and of the whole world (every world divides), and by
// enumeration: pairs, and a list that leaves the last rank out.
int check_subgroups(int rank, int world) {
  for (int size : {1, world}) {
    auto [mine, all] = dtrain::new_subgroups(size);
    if (static_cast<int>(all.size()) != world / size) return fail("new_subgroups count");
    auto t = at::full({4}, rank, at::kLong);
    dtrain::all_reduce(t, dtrain::AllReduceOptions().group(mine));
    const int first = rank / size * size;
    const int64_t want = size * first + size * (size - 1) / 2;
    if (!at::equal(t, at::full({4}, want, at::kLong))) return fail("new_subgroups all_reduce");
  }
  std::vector<std::vector<int>> pairs;
  for (int r = 0; r + 1 < world; r += 2) pairs.push_back({r, r + 1});
  if (pairs.empty()) return 0;
  auto [mine, all] = dtrain::new_subgroups_by_enumeration(pairs);
  const bool listed = rank < static_cast<int>(pairs.size()) * 2;
  if (static_cast<bool>(mine) != listed) return fail("new_subgroups_by_enumeration membership");
  if (mine) {
    auto t = at::full({2}, rank, at::kInt);
    dtrain::all_reduce(t, dtrain::AllReduceOptions().group(mine).op(dtrain::ReduceOp::BXOR));
    if (!at::equal(t, at::full({2}, rank ^ (rank ^ 1), at::kInt))) return fail("pair BXOR");
  }
  std::cout << "rank " << rank << " subgroups ok" << std::endl;
  return 0;
}

int check_matrix(const std::string& backend) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  using dtrain::ReduceOp;
  for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kLong,
                  at::kByte, at::kChar}) {
    const auto name = std::string(c10::toString(dt));
    for (int64_t n : {0, 1, 1031, 70000}) {
      std::vector<ReduceOp> ops = {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT,
                                   ReduceOp::MIN, ReduceOp::MAX};
      if (at::isIntegralType(dt, false))
        ops.insert(ops.end(), {ReduceOp::BAND, ReduceOp::BOR, ReduceOp::BXOR});
      for (auto op : ops) {
        auto acc = pattern(0, n, at::kDouble);
        for (int r = 1; r < world; ++r) {
          auto x = pattern(r, n, at::kDouble);
          const auto a = acc.to(at::kLong), b = x.to(at::kLong);
          if (op == ReduceOp::BAND) acc = a.bitwise_and(b).to(at::kDouble);
          else if (op == ReduceOp::BOR) acc = a.bitwise_or(b).to(at::kDouble);
          else if (op == ReduceOp::BXOR) acc = a.bitwise_xor(b).to(at::kDouble);
          else if (op == ReduceOp::PRODUCT) acc = acc * x;
          else if (op == ReduceOp::MIN) acc = at::minimum(acc, x);
          else if (op == ReduceOp::MAX) acc = at::maximum(acc, x);
          else acc = acc + x;
        }
        at::Tensor want = op != ReduceOp::AVG ? acc.to(dt)
                          : at::isFloatingType(dt) ? acc.to(dt).div(world)
                                                   : acc.div(world, "trunc").to(dt);
        auto t = pattern(rank, n, dt);
        dtrain::all_reduce(t, dtrain::AllReduceOptions().op(op));
        if (!at::equal(t, want)) return fail("all_reduce " + name + " " + dtrain::to_string(op));
        auto r = pattern(rank, n, dt);
        dtrain::reduce(r, world - 1, dtrain::ReduceOptions().op(op));
        if (!at::equal(r, rank == world - 1 ? want : pattern(rank, n, dt)))
          return fail("reduce " + name + " " + dtrain::to_string(op));
      }
      auto b = pattern(rank, n, dt);
      dtrain::broadcast(b, world - 1);
      if (!at::equal(b, pattern(world - 1, n, dt))) return fail("broadcast " + name);
      std::vector<at::Tensor> outs;
      for (int j = 0; j < world; ++j) outs.push_back(at::zeros({n}, dt));
      dtrain::all_gather(outs, pattern(rank, n, dt));
      for (int j = 0; j < world; ++j)
        if (!at::equal(outs[j], pattern(j, n, dt))) return fail("all_gather " + name);
      auto flat = at::zeros({world * n}, dt);
      dtrain::all_gather_into_tensor(flat, pattern(rank, n, dt));
      for (int j = 0; j < world; ++j)
        if (!at::equal(flat.narrow(0, j * n, n), pattern(j, n, dt)))
          return fail("all_gather_into_tensor " + name);
      // Rank r's flat input: world blocks, block j = pattern(r + j); its
      // reduction at block `rank` is the sum over r of pattern(r + rank).
      std::vector<at::Tensor> blocks;
      for (int j = 0; j < world; ++j) blocks.push_back(pattern(rank + j, n, dt));
      auto scattered = at::zeros({n}, dt);
      dtrain::reduce_scatter_tensor(scattered, at::cat(blocks));
      auto want_sum = pattern(rank, n, at::kDouble);
      for (int r = 1; r < world; ++r) want_sum = want_sum + pattern(r + rank, n, at::kDouble);
      if (!at::equal(scattered, want_sum.to(dt))) return fail("reduce_scatter_tensor " + name);
      std::vector<at::Tensor> gathered;
      if (rank == 0)
        for (int j = 0; j < world; ++j) gathered.push_back(at::zeros({n}, dt));
      dtrain::gather(pattern(rank, n, dt), gathered, 0);
      for (int j = 0; j < static_cast<int>(gathered.size()); ++j)
        if (!at::equal(gathered[j], pattern(j, n, dt))) return fail("gather " + name);
      std::vector<at::Tensor> pieces;
      if (rank == 0)
        for (int j = 0; j < world; ++j) pieces.push_back(pattern(10 + j, n, dt));
      auto got = at::zeros({n}, dt);
      dtrain::scatter(got, pieces, 0);
      if (!at::equal(got, pattern(10 + rank, n, dt))) return fail("scatter " + name);
    }
  }
  if (int rc = check_every_collective(rank, world)) return rc;
  if (int rc = check_recv_from_any_rank(rank, world)) return rc;
  dtrain::barrier();
  std::cout << "rank " << rank << " matrix ok on " << dtrain::default_group()->backend_name()
            << std::endl;
  dtrain::destroy_process_group();
  return 0;
}

// monitored_barrier: one that every rank reaches passes; in a second one
// the last rank does not take part, and rank 0 names it. Each rank prints
// its outcome; the last rank waits for the others before it exits.
int monitored(const std::string& backend) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  dtrain::monitored_barrier(nullptr, std::chrono::seconds(30));
  std::cout << "rank " << rank << " passed the monitored barrier" << std::endl;
  if (rank == world - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    std::cout << "rank " << rank << " skipped the second" << std::endl;
    std::_Exit(0);  // the group is broken for the others; leave at once
  }
  try {
    dtrain::monitored_barrier(nullptr, std::chrono::milliseconds(1000));
  } catch (const dtrain::TimeoutError& e) {
    std::cout << "rank " << rank << " monitored_barrier: " << e.what() << std::endl;
  }
  std::_Exit(0);
}

int ddp_equivalence(const std::string& backend, int hidden, torch::Device device) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  auto make = [hidden] {
    torch::manual_seed(0);
    return torch::nn::Sequential(torch::nn::Linear(10, hidden), torch::nn::ReLU(),
                                 torch::nn::Linear(hidden, 4));
  };
  auto net = make();
  auto reference = make();
  net->to(device);
  reference->to(device);
  dtrain::DistributedDataParallel ddp(net.ptr());
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(100 + step * world + r);
      xs.push_back(torch::randn({8, 10}));
      ys.push_back(torch::randn({8, 4}));
    }
    opt.zero_grad();
    torch::mse_loss(ddp.forward(xs[rank].to(device)), ys[rank].to(device)).backward();
    opt.step();
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(torch::cat(xs).to(device)), torch::cat(ys).to(device)).backward();
    ref_opt.step();
    // The largest difference over the largest reference value, per
    // parameter: sums in another order differ in their last bits.
    auto got = ddp.parameters(), want = reference->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      const double off = (got[i] - want[i]).abs().max().item<double>() /
                         want[i].abs().max().item<double>();
      // A GPU's kernels sum in other orders than the CPU's, and than each other.
      if (!(off <= (device.is_cuda() ? 1e-5 : 1e-6)))
        return fail("parameters differ from single-process training at step " +
                    std::to_string(step) + " by " + std::to_string(off) + " relative");
    }
  }
  std::cout << "rank " << rank << " ddp matches single-process training on "
            << dtrain::default_group()->backend_name() << " with tensors on " << device << std::endl;
  dtrain::destroy_process_group();
  return 0;
}

// The store a user would build by hand: rank 0 serves on MASTER_ADDR:MASTER_PORT.
std::shared_ptr<dtrain::Store> user_store() {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  const char* rank = std::getenv("RANK");
  if (!addr || !port || !rank) throw std::runtime_error("user-store needs MASTER_ADDR, MASTER_PORT, RANK");
  return std::make_shared<dtrain::TcpStore>(dtrain::TcpStoreOptions()
                                                .host(addr)
                                                .port(static_cast<uint16_t>(std::stoi(port)))
                                                .is_server(std::stoi(rank) == 0));
}

int check_collectives(const std::string& init_method, const std::string& backend) {
  auto options = dtrain::InitOptions().backend(backend);
  if (init_method == "user-store")
    options.store(user_store());
  else
    options.init_method(init_method);
  dtrain::init_process_group(options);
  const int rank = dtrain::get_rank();
  const int world = dtrain::get_world_size();
  std::cout << "rank " << rank << " backend " << dtrain::default_group()->backend_name()
            << std::endl;
  if (int rc = check_every_collective(rank, world)) return rc;

  auto t = at::full({1000}, rank + 1, at::kFloat);
  dtrain::all_reduce(t);
  if (!at::equal(t, at::full({1000}, world * (world + 1) / 2, at::kFloat)))
    return fail("all_reduce SUM");
  std::cout << "rank " << rank << " all_reduce sum " << t[0].item<float>() << std::endl;

  auto b = at::full({17}, rank == 0 ? 42 : -1, at::kLong);
  dtrain::broadcast(b, 0);
  if (!at::equal(b, at::full({17}, 42, at::kLong))) return fail("broadcast");
  std::cout << "rank " << rank << " broadcast received " << b[0].item<int64_t>() << std::endl;

  std::vector<at::Tensor> outs;
  for (int r = 0; r < world; ++r) outs.push_back(at::empty({3}, at::kInt));
  dtrain::all_gather(outs, at::full({3}, rank, at::kInt));
  for (int r = 0; r < world; ++r)
    if (!at::equal(outs[r], at::full({3}, r, at::kInt))) return fail("all_gather");

  if (int rc = check_recv_from_any_rank(rank, world)) return rc;

  // A subgroup of the even ranks runs while the default group is busy too.
  std::vector<int> evens;
  for (int r = 0; r < world; r += 2) evens.push_back(r);
  auto sub = dtrain::new_group(evens);
  auto big = at::ones({1 << 18});
  auto w1 = dtrain::all_reduce(big, dtrain::AllReduceOptions().async_op(true));
  if (rank % 2 == 0) {
    auto s = at::full({5}, rank, at::kDouble);
    dtrain::all_reduce(s, dtrain::AllReduceOptions().group(sub).op(dtrain::ReduceOp::MAX));
    if (!at::equal(s, at::full({5}, evens.back(), at::kDouble))) return fail("subgroup MAX");
  } else if (sub->rank() != -1) {
    return fail("odd rank is a member of the even subgroup");
  }
  w1->wait();
  if (!at::equal(big, at::full({1 << 18}, world, at::kFloat))) return fail("async all_reduce");
  if (int rc = check_subgroups(rank, world)) return rc;
  dtrain::barrier();
  std::cout << "rank " << rank << " ok" << std::endl;
  dtrain::destroy_process_group();
  return 0;
}

const char* type_name(const dtrain::Error& e) {
  if (dynamic_cast<const dtrain::TimeoutError*>(&e)) return "TimeoutError";
  if (dynamic_cast<const dtrain::NetworkError*>(&e)) return "NetworkError";
  if (dynamic_cast<const dtrain::InvalidArgument*>(&e)) return "InvalidArgument";
  if (dynamic_cast<const dtrain::CollectiveMismatch*>(&e)) return "CollectiveMismatch";
  if (dynamic_cast<const dtrain::BackendUnavailable*>(&e)) return "BackendUnavailable";
  return "Error";
}

int ddp_training() {
  dtrain::init_process_group();
  const int rank = dtrain::get_rank();
  torch::manual_seed(rank);  // different initial weights and data on every rank
  auto net = torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(),
                                   torch::nn::Linear(32, 4));
  dtrain::DistributedDataParallel ddp(net.ptr());
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto x = torch::randn({8, 10}), y = torch::randn({8, 4});
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    torch::mse_loss(ddp.forward(x), y).backward();
    opt.step();
  }
  double checksum = 0;
  for (const auto& p : ddp.parameters()) checksum += p.to(at::kDouble).abs().sum().item<double>();
  std::printf("rank %d params %.17g\n", rank, checksum);
  std::fflush(stdout);
  dtrain::destroy_process_group();
  return 0;
}

// Each send and recv completes on its own: rank 0's send of tag 2 while its
// receive of tag 1, posted first, waits for rank 1's reply to two sends.
int p2p_order(const std::string& backend) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank();
  auto& g = *dtrain::default_group();
  if (rank == 0) {
    auto in = at::zeros({4});
    auto r = g.recv(in, 1, 1);
    g.send(at::full({4}, 2.0f), 1, 2)->wait();
    if (r->is_completed()) throw std::runtime_error("the receive completed before its message");
    g.send(at::full({4}, 3.0f), 1, 3)->wait();
    r->wait();
    if (!at::equal(in, at::full({4}, 1.0f))) throw std::runtime_error("wrong data received");
  } else if (rank == 1) {
    auto a = at::zeros({4}), b = at::zeros({4});
    g.recv(a, 0, 2)->wait();
    g.recv(b, 0, 3)->wait();
    g.send(at::full({4}, 1.0f), 0, 1)->wait();
    if (!at::equal(a, at::full({4}, 2.0f)) || !at::equal(b, at::full({4}, 3.0f)))
      throw std::runtime_error("wrong data received");
  }
  dtrain::barrier();
  std::cout << "rank " << rank << " p2p order ok on " << backend << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "trace-uncaught") return trace_uncaught();  // outside the try: the error escapes
  try {
    if (mode == "collectives")
      return check_collectives(argc > 2 ? argv[2] : "env://", argc > 3 ? argv[3] : "auto");
    if (mode == "loop") return loop(argc > 2 ? argv[2] : "auto");
    if (mode == "p2p-loop") return p2p_loop(argc > 2 ? argv[2] : "auto");
    if (mode == "peer-leaves") return peer_leaves(argc > 2 ? argv[2] : "auto");
    if (mode == "recv-from-last") return recv_from_last(argc > 2 ? argv[2] : "auto");
    if (mode == "matrix") return check_matrix(argc > 2 ? argv[2] : "auto");
    if (mode == "ddp-equivalence")
      return ddp_equivalence(argc > 2 ? argv[2] : "auto",
                             argc > 3 && argv[3] == std::string("wide") ? 4096 : 32, worker_device(argc, argv));
    const std::string backend = argc > 2 ? argv[2] : "auto";
    if (mode == "fsdp-equivalence")
      return fsdp_equivalence(backend, FsdpVariant::kFull, worker_device(argc, argv));
    if (mode == "fsdp-sharded-construction")
      return fsdp_equivalence(backend, FsdpVariant::kShardedConstruction, worker_device(argc, argv));
    if (mode == "hsdp-equivalence")
      return fsdp_equivalence(backend, FsdpVariant::kHybrid, worker_device(argc, argv));
    if (mode.rfind("pipeline-", 0) == 0)
      return pipeline_equivalence(mode.substr(9), backend, worker_device(argc, argv));
    if (mode == "zero1-equivalence") return zero_equivalence(backend, 1, worker_device(argc, argv));
    if (mode == "zero2-equivalence") return zero_equivalence(backend, 2, worker_device(argc, argv));
    if (mode == "syncbn-equivalence") return syncbn_equivalence(backend, worker_device(argc, argv));
    if (mode == "tp-equivalence") return tp_equivalence(backend, worker_device(argc, argv));
    if (mode == "ep-equivalence") return ep_equivalence(backend, worker_device(argc, argv));
    if (mode == "diloco-equivalence") return diloco_equivalence(backend, worker_device(argc, argv));
    if (mode == "checkpoint-crash" && argc > 3) return checkpoint_crash(argv[2], argv[3], false);
    if (mode == "checkpoint-check" && argc > 2) return checkpoint_crash(argv[2], "", true);
    if (mode == "monitored") return monitored(argc > 2 ? argv[2] : "auto");
    if (mode == "p2p-order") return p2p_order(argc > 2 ? argv[2] : "auto");
    if (mode == "mismatch") return mismatch();
    if (mode == "trace" && argc > 3) return trace_fault(argv[2], argv[3]);
    if (mode == "timeline") return timeline_training();
    if (mode == "page-faults") return page_faults(argc > 2 ? std::stoi(argv[2]) : 40);
    if (mode == "fsdp-malloc") return fsdp_malloc();
    if (mode == "ddp") return ddp_training();
    if (mode == "cuda-devices") {
      // As a number: libtorch 2.x returns c10::DeviceIndex (a char type),
      // which a stream would write as a character.
      std::cout << "cuda devices: " << static_cast<int>(torch::cuda::device_count()) << std::endl;
      return 0;
    }
    if (mode == "init") {
      dtrain::init_process_group();
      std::cout << "initialized" << std::endl;
      return 0;
    }
  } catch (const dtrain::Error& e) {
    std::cout << "caught " << type_name(e) << ": " << e.what() << std::endl;
    return mode == "init" ? 2 : 3;
  }
  std::cerr << "usage: rank_worker collectives|loop|init|mismatch|ddp" << std::endl;
  return 64;
}
