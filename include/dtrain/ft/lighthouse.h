#pragma once

// The lighthouse of a fault-tolerant job (torchft's Lighthouse): the one
// server every replica group registers with, which forms a quorum of the
// live replicas at every step. docs/fault-tolerance.md has the model.
//
//   dtrain::ft::Lighthouse lighthouse(dtrain::ft::LighthouseOptions()
//                                         .host("10.0.0.1").port(29510).min_replicas(2));
//   // or the tool: dtrain-lighthouse --host 10.0.0.1 --port 29510 --min-replicas 2
//
// Contract:
//  - The lighthouse is a TCP store (dtrain/store/tcp_store.h: the job
//    token, bounded resources, hostile input refused) and a thread that
//    reads the replicas' quorum requests from it and answers them. The
//    replicas' managers (dtrain/ft/manager.h) talk to it; where each
//    cross-replica group rendezvous is one key in it, while it is built.
//  - A replica is live while its heartbeats (every
//    ManagerOptions::heartbeat_interval) or its requests arrive within
//    heartbeat_timeout; that timeout is how long the death of a replica
//    that asked for no quorum since takes to be known. A replica that asks
//    and then falls silent is left out of quorums, its request kept and
//    answered once it beats again (forgotten after ten timeouts).
//  - A quorum forms when at least min_replicas live replicas asked for one
//    and either every replica of the previous quorum asked again (the fast
//    path of a healthy job: new joiners that asked are let in), or every
//    live replica asked, or join_timeout passed since the first asked.
//    Its id changes exactly when its members do.
//  - The first replica to ask fixes the job's layout (its number of ranks
//    and its manager's fingerprint of the state); a replica that asks with
//    another is answered with an error naming both, and nothing else is
//    disturbed.
//  - A member of the newest quorum whose heartbeats stop for
//    heartbeat_timeout is declared dead in that quorum (a verdict every
//    rank of the other members watches for): their cross-replica groups
//    are aborted at once, so a replica that went silent (a host lost, a
//    link cut, a process stopped) costs the others heartbeat_timeout and
//    not their operations' timeout. A death that closes the connections
//    (a process killed) is known sooner, from them.
//  - A lighthouse that dies takes no replica with it: their quorum
//    requests fail (each such step is not committed) until a lighthouse
//    answers at the same address again; a new one forms quorums from the
//    requests it receives, with new ids.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/arg.h"

namespace dtrain::ft {

struct LighthouseOptions {
  DTRAIN_ARG(std::string, host) = "127.0.0.1";
  // 0: a free port (read it back with port()).
  DTRAIN_ARG(uint16_t, port) = 29510;
  // The fewest replicas a quorum may have.
  DTRAIN_ARG(int, min_replicas) = 1;
  // How long a quorum waits for live replicas that have not asked yet.
  DTRAIN_ARG(std::chrono::milliseconds, join_timeout) = std::chrono::seconds(60);
  // A replica whose heartbeats stop for this long is dead to the quorum.
  DTRAIN_ARG(std::chrono::milliseconds, heartbeat_timeout) = std::chrono::seconds(5);
  // How often heartbeats and registrations are read and the quorum rule
  // applied (a request is read the moment it arrives).
  DTRAIN_ARG(std::chrono::milliseconds, tick) = std::chrono::milliseconds(100);
  // The job token (TcpStoreOptions::token): empty, DTRAIN_STORE_TOKEN or
  // DTRAIN_STORE_TOKEN_FILE.
  DTRAIN_ARG(std::string, token) = "";
};

// What the lighthouse has done so far (for progress lines and tests).
struct LighthouseStatus {
  std::string quorum_id;             // the newest quorum's; empty before the first
  std::vector<std::string> members;  // its replicas, in id order
  int64_t quorums = 0;               // answers given (one per member per quorum)
  int64_t refused = 0;               // requests answered with an error
  int64_t replicas = 0;              // replicas it follows (live, or silent for under ten heartbeat timeouts)
  int64_t deaths = 0;                // members declared dead in their quorum
};

class Lighthouse {
 public:
  // Binds host:port (NetworkError when it is in use) and starts serving.
  explicit Lighthouse(const LighthouseOptions& options = LighthouseOptions());
  // Stops serving; replicas' requests then fail until another answers.
  ~Lighthouse();
  Lighthouse(const Lighthouse&) = delete;
  Lighthouse& operator=(const Lighthouse&) = delete;

  const std::string& host() const;
  uint16_t port() const;
  std::string address() const;  // "host:port", what ManagerOptions::lighthouse takes
  LighthouseStatus status() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::ft
