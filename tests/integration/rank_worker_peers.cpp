// rank_worker's modes about peers that fail, leave or die while a rank
// waits: the loops that peer-failure tests kill or stop a rank of, and the
// idle modes (rank_worker.cpp lists every mode).

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <thread>

#include "dtrain/dtrain.h"
#include "integration/rank_worker.h"

namespace {

long process_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<long>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}

}  // namespace

int loop(const std::string& backend) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  std::cout << "rank " << dtrain::get_rank() << " ready" << std::endl;
  auto t = at::ones({4096});
  for (long step = 0;; ++step) {
    dtrain::all_reduce(t);
    if (step % 200 == 0) std::cout << "rank " << dtrain::get_rank() << " steps " << step << std::endl;
  }
}

int p2p_loop(const std::string& backend) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  std::cout << "rank " << rank << " ready" << std::endl;
  auto out = at::full({4096}, float(rank)), in = at::zeros({4096});
  auto& g = *dtrain::default_group();
  for (long step = 0;; ++step) {
    auto r = g.recv(in, (rank + world - 1) % world);
    g.send(out, (rank + 1) % world)->wait();
    r->wait();
    if (step % 200 == 0) std::cout << "rank " << rank << " steps " << step << std::endl;
  }
}

int peer_leaves(const std::string& backend) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank();
  dtrain::barrier();
  if (rank != 0) {
    dtrain::destroy_process_group();
    std::cout << "rank " << rank << " left" << std::endl;
    return 0;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the peers' closes arrive
  const long before = process_cpu_ms();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::cout << "rank 0 cpu_ms " << process_cpu_ms() - before << std::endl;
  dtrain::destroy_process_group();
  return 0;
}

int recv_from_last(const std::string& backend) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  dtrain::barrier();
  std::cout << "rank " << rank << " ready" << std::endl;
  if (rank != 0) {
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  auto in = at::zeros({16});
  dtrain::default_group()->recv(in, world - 1)->wait();
  return fail("rank 0 received from a rank that never sends");
}
