// A rendezvous of N clients against one TCP store, on loopback: each client
// thread connects, announces itself and waits until every other has.
// Two ways of waiting, timed side by side:
//   keys     each client sets "joined/<r>" and waits on all N such keys (the
//            join barrier dtrain used before: O(N^2) keys in waits)
//   counter  each client sets "joined/<r>", add()s a counter, and the last
//            one sets a release key the others wait on (init_process_group's
//            join barrier now: O(1) requests per client)
// Usage: store-rendezvous-bench [clients=1024] [repeats=3]
// Prints the median seconds of each and their ratio.

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/store/tcp_store.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double rendezvous(int n, bool counter) {
  dtrain::TcpStore server(
      dtrain::TcpStoreOptions().host("127.0.0.1").port(0).is_server(true).timeout(120s));
  const uint16_t port = server.port();
  std::vector<std::unique_ptr<dtrain::TcpStore>> clients;
  for (int r = 0; r < n; ++r)  // connected before the clock starts
    clients.push_back(std::make_unique<dtrain::TcpStore>(
        dtrain::TcpStoreOptions().host("127.0.0.1").port(port).timeout(120s)));
  std::vector<std::string> all_keys;
  for (int r = 0; r < n; ++r) all_keys.push_back("joined/" + std::to_string(r));
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto& s = *clients[r];
      s.set(all_keys[r], "1");
      if (!counter) {
        s.wait(all_keys);
        return;
      }
      if (s.add("joined/count", 1) == n) s.set("joined/all", "1");
      s.wait({"joined/all"});
    });
  }
  for (auto& t : threads) t.join();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median_of(int repeats, int n, bool counter) {
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) t.push_back(rendezvous(n, counter));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 1024;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  if (n < 1 || repeats < 1) {
    std::fprintf(stderr, "usage: store-rendezvous-bench [clients>=1] [repeats>=1]\n");
    return 2;
  }
  rlimit lim{};  // two descriptors per client, both in this process
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur < rlim_t(2 * n + 64)) {
    std::fprintf(stderr, "store-rendezvous-bench: %d clients need %d descriptors; the limit is %llu\n",
                 n, 2 * n + 64, static_cast<unsigned long long>(lim.rlim_cur));
    return 1;
  }
  const double keys = median_of(repeats, n, false);
  const double counter = median_of(repeats, n, true);
  std::printf("store rendezvous, %d clients on loopback, median of %d:\n", n, repeats);
  std::printf("  keys    (wait on N keys)        %8.3f s\n", keys);
  std::printf("  counter (add + one release key) %8.3f s\n", counter);
  std::printf("  ratio keys/counter              %8.2f\n", keys / counter);
  return 0;
}
