// dtrain-lighthouse: the lighthouse of a fault-tolerant job
// (dtrain/ft/lighthouse.h, docs/fault-tolerance.md). Serves until SIGINT or
// SIGTERM; prints a line per new quorum.

#include <CLI/CLI.hpp>

#include <csignal>
#include <ctime>
#include <iostream>

#include "dtrain/errors.h"
#include "dtrain/ft/lighthouse.h"

namespace {

std::string members_text(const std::vector<std::string>& members) {
  std::string out;
  for (const auto& m : members) out += (out.empty() ? "" : ", ") + m;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain-lighthouse: forms the quorum of live replicas of a fault-tolerant job at each step"};
  std::string host = "127.0.0.1";
  int port = 29510, min_replicas = 1;
  double join_timeout_s = 60, heartbeat_timeout_s = 5;
  app.add_option("--host", host, "address to listen on (the replicas' DTRAIN_FT_LIGHTHOUSE host)")
      ->capture_default_str();
  app.add_option("--port", port, "port to listen on (0: a free one, printed)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--min-replicas", min_replicas, "the fewest replicas a quorum may have")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--join-timeout", join_timeout_s, "seconds a quorum waits for live replicas that have not asked")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.add_option("--heartbeat-timeout", heartbeat_timeout_s,
                 "seconds without a heartbeat after which a replica is dead to the quorum")
      ->check(CLI::Range(0.01, 3600.0))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  // Blocked here, before the lighthouse starts its threads: only the loop
  // below takes them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  try {
    using std::chrono::milliseconds;
    dtrain::ft::Lighthouse lighthouse(dtrain::ft::LighthouseOptions()
                                          .host(host)
                                          .port(static_cast<uint16_t>(port))
                                          .min_replicas(min_replicas)
                                          .join_timeout(milliseconds(static_cast<int64_t>(join_timeout_s * 1000)))
                                          .heartbeat_timeout(milliseconds(static_cast<int64_t>(heartbeat_timeout_s * 1000))));
    std::cout << "dtrain-lighthouse: serving on " << lighthouse.address() << " (min replicas " << min_replicas
              << ", heartbeat timeout " << heartbeat_timeout_s << " s)" << std::endl;
    std::string shown;
    int64_t refused = 0;
    const timespec tick{0, 200 * 1000 * 1000};
    for (;;) {
      const int sig = sigtimedwait(&stop_signals, nullptr, &tick);
      if (sig == SIGINT || sig == SIGTERM) {
        std::cout << "dtrain-lighthouse: stopping on " << (sig == SIGINT ? "SIGINT" : "SIGTERM") << std::endl;
        return 0;
      }
      const auto status = lighthouse.status();
      if (status.quorum_id != shown) {
        shown = status.quorum_id;
        std::cout << "dtrain-lighthouse: quorum " << shown << ": " << status.members.size() << " replica"
                  << (status.members.size() == 1 ? "" : "s") << " (" << members_text(status.members) << ")"
                  << std::endl;
      }
      if (status.refused != refused) {
        std::cout << "dtrain-lighthouse: " << status.refused - refused << " request(s) refused (the replica was told why)"
                  << std::endl;
        refused = status.refused;
      }
    }
  } catch (const dtrain::Error& e) {
    std::cerr << "dtrain-lighthouse: " << e.what() << std::endl;
    return 1;
  }
}
