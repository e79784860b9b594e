// A worker for the launcher tests: reports what dtrain-run gave it and
// misbehaves on request.
//   probe env               print the worker contract as "env KEY=VALUE"
//   probe arg X             print "arg X" (checks ${local_rank} substitution)
//   probe exit CODE         rank 1 prints a line and exits with CODE; others wait
//   probe signal            rank 1 raises SIGSEGV; others wait
//   probe fail-until N      every rank fails (exit 3) while TORCHELASTIC_RESTART_COUNT < N
//   probe sleep             fork a grandchild, print both pids, sleep until killed
//   probe stdin             print "stdin eof", "stdin data" or (nothing within 3 s) "stdin open"
//   probe daemon            fork a grandchild that leaves the process group (setsid),
//                           keeps stdout open and sleeps 60 s; print its pid, exit 0
//   probe allreduce [SECS]  dtrain all_reduce of ones, prints "rank R sum S", then
//                           keeps all-reducing for SECS seconds (default 0)
//   probe grow SECS         dtrain all_reduce of ones, prints "rank R sum S world W attempt
//                           A"; on attempt 0 keeps all-reducing for SECS seconds (until a
//                           scale-up stops it), on a later attempt exits at once
//   probe throw             init_process_group, then rank 1 throws an uncaught
//                           std::out_of_range; others wait
//   probe record            rank 1 catches a std::invalid_argument, records it with
//                           dtrain::record_error and exits 2; others wait
//   probe error-file TEXT   rank 1 writes TEXT to $TORCHELASTIC_ERROR_FILE itself (as a
//                           program without dtrain) and exits 3; others wait
//   probe take-place PORT ID
//                           not a worker: a launcher that dies while joining. On the
//                           rendezvous store at 127.0.0.1:PORT (rendezvous id ID),
//                           waits until a node has joined round 0, takes the next
//                           place in it (its count) without writing its address,
//                           prints "took place N" and exits
//   probe rdzv-keys N       prints which rendezvous keys of each earlier round are
//                           still in the launcher's store ("attempt A round R: KEYS"),
//                           then fails (exit 3) while TORCHELASTIC_RESTART_COUNT < N

#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "dtrain/dtrain.h"

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);  // test code: reads the launcher's contract directly
  return v ? std::atoi(v) : -1;
}

[[noreturn]] void wait_forever() {
  for (;;) pause();
}

std::shared_ptr<dtrain::Store> rendezvous_store(int port, const std::string& id) {
  auto tcp = std::make_shared<dtrain::TcpStore>(dtrain::TcpStoreOptions()
                                                    .host("127.0.0.1")
                                                    .port(static_cast<uint16_t>(port))
                                                    .timeout(std::chrono::seconds(20)));
  return std::make_shared<dtrain::PrefixStore>("dtrain-run/" + id, tcp);
}

int take_place(int port, const std::string& id) {
  auto store = rendezvous_store(port, id);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (store->add("round/0/count", 0) < 1) {
    if (std::chrono::steady_clock::now() > deadline) return 2;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::printf("took place %lld\n", static_cast<long long>(store->add("round/0/count", 1) - 1));
  return 0;
}

int rdzv_keys(int fail_until) {
  const int attempt = env_int("TORCHELASTIC_RESTART_COUNT");
  auto store = rendezvous_store(env_int("MASTER_PORT"), std::getenv("TORCHELASTIC_RUN_ID"));
  for (int round = 0; round < attempt; ++round) {
    std::string present;
    for (const char* k : {"node/0", "failed", "counted", "alive/0"})
      if (store->check({"round/" + std::to_string(round) + "/" + k})) present += std::string(" ") + k;
    std::printf("attempt %d round %d:%s\n", attempt, round, present.empty() ? " (none)" : present.c_str());
  }
  return attempt < fail_until ? 3 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int rank = env_int("RANK");
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (mode == "env") {
    for (const char* k : {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                          "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                          "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                          "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                          "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS"}) {
      const char* v = std::getenv(k);
      std::printf("env %s=%s\n", k, v ? v : "<unset>");
    }
    const char* token = std::getenv("DTRAIN_STORE_TOKEN");  // its length only, never the token
    std::printf("env DTRAIN_STORE_TOKEN length %zu\n", token ? std::strlen(token) : size_t(0));
    return 0;
  }
  if (mode == "arg" && argc > 2) {
    std::printf("arg %s\n", argv[2]);
    return 0;
  }
  if (mode == "exit" && argc > 2) {
    if (rank != 1) wait_forever();
    std::printf("about to fail on purpose\n");
    std::fprintf(stderr, "stderr line before failing\n");
    return std::atoi(argv[2]);
  }
  if (mode == "signal") {
    if (rank != 1) wait_forever();
    std::printf("about to crash\n");
    raise(SIGSEGV);
    return 0;
  }
  if (mode == "fail-until" && argc > 2) {
    const int attempt = env_int("TORCHELASTIC_RESTART_COUNT");
    std::printf("attempt %d\n", attempt);
    return attempt < std::atoi(argv[2]) ? 3 : 0;
  }
  if (mode == "sleep") {
    pid_t child = fork();
    if (child == 0) wait_forever();
    std::printf("pids %d %d\n", static_cast<int>(getpid()), static_cast<int>(child));
    wait_forever();
  }
  if (mode == "stdin") {
    pollfd p{STDIN_FILENO, POLLIN, 0};
    char c;
    if (::poll(&p, 1, 3000) == 0) std::printf("stdin open\n");
    else std::printf(read(STDIN_FILENO, &c, 1) == 0 ? "stdin eof\n" : "stdin data\n");
    return 0;
  }
  if (mode == "daemon") {
    pid_t child = fork();
    if (child == 0) {
      setsid();
      sleep(60);
      _exit(0);
    }
    std::printf("daemon %d\n", static_cast<int>(child));
    return 0;
  }
  if (mode == "grow" && argc > 2) {
    dtrain::init_process_group();
    auto t = at::ones({1000});
    dtrain::all_reduce(t);
    std::printf("rank %d sum %g world %d attempt %d\n", dtrain::get_rank(), t[0].item<double>(),
                dtrain::get_world_size(), dtrain::restart_count());
    const int rounds = dtrain::restart_count() == 0 ? static_cast<int>(std::atof(argv[2]) * 50) : 0;
    for (int i = 0; i < rounds; ++i) {
      dtrain::all_reduce(t);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    dtrain::destroy_process_group();
    return 0;
  }
  if (mode == "throw") {
    dtrain::init_process_group();
    if (rank != 1) wait_forever();
    throw std::out_of_range("batch 7 has no label 11 (deliberately thrown on rank 1)");
  }
  if (mode == "record") {
    if (rank != 1) wait_forever();
    try {
      throw std::invalid_argument("--lr must be positive, got -1");
    } catch (const std::exception& e) {
      std::printf("recorded %d\n", dtrain::record_error(e) ? 1 : 0);
      return 2;
    }
  }
  if (mode == "error-file" && argc > 2) {
    if (rank != 1) wait_forever();
    const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
    if (FILE* f = path ? std::fopen(path, "w") : nullptr) {
      std::fputs(argv[2], f);
      std::fclose(f);
    }
    return 3;
  }
  if (mode == "take-place" && argc > 3) return take_place(std::atoi(argv[2]), argv[3]);
  if (mode == "rdzv-keys" && argc > 2) return rdzv_keys(std::atoi(argv[2]));
  if (mode == "allreduce") {
    dtrain::init_process_group();
    auto t = at::ones({1000});
    dtrain::all_reduce(t);
    std::printf("rank %d sum %g world %d\n", dtrain::get_rank(), t[0].item<double>(),
                dtrain::get_world_size());
    // A fixed count (not a deadline), so every rank issues the same collectives.
    const int rounds = static_cast<int>((argc > 2 ? std::atof(argv[2]) : 0) * 50);
    for (int i = 0; i < rounds; ++i) {
      dtrain::all_reduce(t);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    dtrain::destroy_process_group();
    return 0;
  }
  std::fprintf(stderr, "probe: unknown mode '%s'\n", mode.c_str());
  return 64;
}
