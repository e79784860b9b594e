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
// A round number is the workers' TORCHELASTIC_RESTART_COUNT: after a
// failure every node moves to the next round, and the store counts the
// failed rounds, so the restart budget is the job's, whichever node fails or
// rejoins. During a round each node bumps a keep-alive counter; a node whose
// counter stops moving for keep_alive_max_attempt intervals is declared
// gone, which fails the round for everyone. The keys of a round are deleted
// two rounds later, once all of its nodes have moved on, so a job that
// restarts often keeps two rounds of keys in the store, not all of them.
//
// Scale-up (c10d, torchrun's behaviour): a node that arrives while a round
// of fewer than MAX nodes runs waits for the next round; the running nodes
// see it waiting at their next monitor tick, end the round (their workers
// stop) and meet again with it. Such a round ends without using the restart
// budget.

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/store/store.h"
#include "dtrain/store/tcp_store.h"
#include "options.h"

namespace dtrain::run {

// Why a round ended early.
struct RoundEnd {
  bool scale_up = false;  // nodes are waiting to join; not a failure
  std::string reason;
};

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
  // Blocks until a round from `round` on has formed (TimeoutError after
  // join_timeout naming who is missing). A node that arrives after round
  // `round` closed waits in it for the next one (scale-up) when the round
  // has fewer than MAX nodes; the Round returned says which it joined.
  Round join(int round);
  // Called every monitor tick; says when the round has ended: failed
  // (reported by any node, or a node stopped sending keep-alives), or
  // ended for a scale-up because nodes are waiting to join.
  std::optional<RoundEnd> check(const Round& round);
  // Records a failure unless the round already ended; returns how the
  // round ended (the first report wins, so workers that fail because a
  // scale-up stopped their peers do not count as a failure).
  RoundEnd report_failure(const Round& round, const std::string& reason);
  // Failed rounds so far: the restarts the job has used.
  int restarts_used();
  void report_done(const Round& round);
  // The store host waits for the other nodes to finish before taking the
  // store down; false if one failed or stopped sending keep-alives.
  bool wait_for_others(const Round& round);
  // Moves everyone to round + 1 (idempotent); the first node to move it
  // counts a failed round against the restart budget.
  void advance(int round);
  bool hosts_store() const { return host_; }
  const std::string& local_address() const { return local_address_; }
  std::string endpoint() const;

 private:
  std::shared_ptr<TcpStore> connect_client(const TcpStoreOptions& base);
  void wait_keys(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  std::string key(int round, const std::string& rest) const;
  // Ends the round with `end` unless it already ended; returns how it ended.
  RoundEnd end_round(int round, const RoundEnd& end);
  std::optional<RoundEnd> ended(int round);
  bool any_done(const Round& round);
  // A late node: waits in `round` until the running nodes start a new one.
  void wait_for_next_round(int round, int participants);
  // The round a node arriving at `round` can join: `round` itself, or a
  // later one after waiting in a closed round that has room (scale-up).
  int round_with_room(int round);
  int join_static(int round, const std::string& me);
  std::pair<int, int> join_dynamic(int round, const std::string& me);
  // Every participant's number of workers, in node order.
  std::vector<int> node_table(int round, int participants);
  // Deletes round `round`'s keys when no participant can need them.
  void prune(int round);
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
