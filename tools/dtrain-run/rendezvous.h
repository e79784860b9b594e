#pragma once

// Rendezvous of the launchers (one per node) through a dtrain TCP store.
// Every blocking step throws Interrupted (signals.h) soon after the
// launcher is signalled.
//
// Static (--rdzv-backend static): node 0 hosts the store on
// --master-addr:--master-port; every round waits for all --nnodes nodes,
// whose ranks are given (--node-rank).
// Dynamic (--rdzv-backend c10d): the node that owns the --rdzv-endpoint
// address hosts the store; nodes join a round in arrival order; the round
// closes at MAX nodes, or at MIN nodes once last_call_timeout has passed
// without another joining. Ranks are contiguous blocks, one per node, in
// node order.
//
// A round number is also the restart count: after a failure every node
// moves to the next round, so the restart budget is the job's, whichever
// node fails or rejoins. During a round each node bumps a keep-alive
// counter; a node whose counter stops moving for keep_alive_max_attempt
// intervals is declared gone, which fails the round for everyone.

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/store/store.h"
#include "dtrain/store/tcp_store.h"
#include "options.h"

namespace dtrain::run {

struct Round {
  int number = 0;
  int node_rank = 0;
  int nnodes = 1;
  int rank_offset = 0;
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
};

class Rendezvous {
 public:
  // Hosts or connects to the store; throws dtrain::Error naming host:port.
  explicit Rendezvous(const Options& options);

  // The round a (re)starting node should join.
  int current_round();
  // Blocks until the round has formed (TimeoutError after join_timeout
  // naming who is missing).
  Round join(int round);
  // Called every monitor tick; returns a reason when the round has failed
  // (reported by any node, or a node stopped sending keep-alives).
  std::optional<std::string> check(const Round& round);
  void report_failure(const Round& round, const std::string& reason);
  void report_done(const Round& round);
  // The store host waits for the other nodes to finish before taking the
  // store down; false if one failed or stopped sending keep-alives.
  bool wait_for_others(const Round& round);
  // Moves everyone to round + 1 (idempotent).
  void advance(int round);
  bool hosts_store() const { return host_; }
  const std::string& local_address() const { return local_address_; }
  std::string endpoint() const;

 private:
  std::shared_ptr<TcpStore> connect_client(const TcpStoreOptions& base);
  void wait_keys(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  std::string key(int round, const std::string& rest) const;
  const Options& options_;
  std::shared_ptr<Store> store_;
  bool host_ = false;
  std::string store_host_;
  int store_port_ = 0;
  std::string local_address_;
  // keep-alive bookkeeping
  std::chrono::steady_clock::time_point next_beat_;
  int64_t beats_ = 0;
  std::vector<int64_t> last_seen_;
  std::vector<int> stale_checks_;
};

}  // namespace dtrain::run
