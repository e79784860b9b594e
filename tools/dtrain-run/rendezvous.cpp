#include "rendezvous.h"

#include <algorithm>
#include <iostream>
#include <sstream>
#include <tuple>
#include <utility>
#include <thread>

#include "common/socket.h"
#include "dtrain/errors.h"
#include "dtrain/store/prefix_store.h"
#include "dtrain/store/tcp_store.h"
#include "signals.h"

namespace dtrain::run {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(50);
// The longest a blocking store call runs before the launcher looks for a signal.
constexpr auto kSlice = std::chrono::milliseconds(200);

bool is_loopback_name(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

}  // namespace

Rendezvous::Rendezvous(const Options& o) : options_(o) {
  const bool elastic = o.elastic();
  store_host_ = elastic ? o.rdzv_host : o.master_addr;
  store_port_ = elastic ? o.rdzv_port : o.master_port;
  auto base_options = TcpStoreOptions().host(store_host_).timeout(o.join_timeout);
  std::shared_ptr<TcpStore> store;
  if (!elastic) {
    host_ = o.node_rank == 0;
    store = host_ ? std::make_shared<TcpStore>(TcpStoreOptions(base_options)
                                                   .port(static_cast<uint16_t>(store_port_))
                                                   .is_server(true))
                  : connect_client(base_options);
  } else {
    // The node that owns the endpoint address hosts the store; any other
    // node (or a second launcher on the same machine) is a client.
    try {
      store = std::make_shared<TcpStore>(
          TcpStoreOptions(base_options).port(static_cast<uint16_t>(store_port_)).is_server(true));
      host_ = true;
    } catch (const NetworkError& e) {
      const std::string why = e.what();
      if (why.find("in use") == std::string::npos && why.find("assign") == std::string::npos)
        throw;
      store = connect_client(base_options);
    }
  }
  store_port_ = store->port();
  store_ = std::make_shared<PrefixStore>("dtrain-run/" + o.rdzv_id, store);
  // The store host's name may need DNS, which can stall: bounded by the
  // join timeout, and a signal stops it.
  local_address_ = !o.local_addr.empty()           ? o.local_addr
                   : is_loopback_name(store_host_) ? "127.0.0.1"
                                                   : net::local_address_towards(
                                                         store_host_, Clock::now() + o.join_timeout,
                                                         throw_if_signalled);
}

// Connects to the store host within join_timeout, in short tries, so that a
// signal stops the launcher while the host is not up yet.
std::shared_ptr<TcpStore> Rendezvous::connect_client(const TcpStoreOptions& base) {
  const auto deadline = Clock::now() + options_.join_timeout;
  for (;;) {
    throw_if_signalled();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      auto store = std::make_shared<TcpStore>(TcpStoreOptions(base)
                                                  .port(static_cast<uint16_t>(store_port_))
                                                  .timeout(std::clamp(left, kPoll, kSlice)));
      store->set_timeout(options_.join_timeout);
      return store;
    } catch (const TimeoutError&) {
      if (Clock::now() >= deadline) throw;
    }
  }
}

// store_->wait() in slices, checking for a signal between them.
void Rendezvous::wait_keys(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    throw_if_signalled();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      store_->wait(keys, std::clamp(left, std::chrono::milliseconds(1), kSlice));
      return;
    } catch (const TimeoutError&) {
      if (Clock::now() >= deadline) throw;
    }
  }
}

std::string Rendezvous::endpoint() const {
  return store_host_ + ":" + std::to_string(store_port_);
}

std::string Rendezvous::key(int round, const std::string& rest) const {
  return "round/" + std::to_string(round) + "/" + rest;
}

int Rendezvous::current_round() {
  return static_cast<int>(store_->add("current_round", 0));
}

void Rendezvous::advance(int round) {
  // Every node of the ended round calls this; only the first moves it, and
  // exactly one counts the round when it failed.
  // How the round ended is read before this node counts itself out of it:
  // once every node has, the round's keys may be deleted (prune).
  const auto now = std::to_string(round), next = std::to_string(round + 1);
  store_->compare_set("current_round", {now.begin(), now.end()}, {next.begin(), next.end()});
  const auto end = ended(round);
  if (store_->add(key(round, "counted"), 1) != 1) return;
  if (!end || !end->scale_up) store_->add("restarts_used", 1);
}

// A round's keys are deleted once no participant can still read them: by
// node 0 of round + 2 (every node of that round has left `round` behind),
// and only when every participant of `round` has counted itself out of it
// in advance() (a node of `round` that has not — dead, or still stopping
// its workers — keeps them). A node that never got a place (one beyond MAX)
// reads no more than "closed" and "count" before it gives up.
void Rendezvous::prune(int round) {
  if (round < 0 || !store_->check({key(round, "counted")})) return;
  int participants = options_.max_nodes;
  int places = participants;
  if (options_.elastic()) {
    if (!store_->check({key(round, "closed")})) return;
    const auto closed = store_->get_string(key(round, "closed"));
    if (closed.empty() || closed.size() > 6 || closed.find_first_not_of("0123456789") != std::string::npos)
      return;  // not a launcher's value: leave the round alone
    participants = std::stoi(closed);
    places = std::max<int>(participants, static_cast<int>(store_->add(key(round, "count"), 0)));
  }
  if (store_->add(key(round, "counted"), 0) < participants) return;
  for (int i = 0; i < places; ++i)
    for (const char* k : {"node/", "alive/", "done/"})
      store_->delete_key(key(round, k + std::to_string(i)));
  for (const char* k : {"count", "closed", "waiting", "failed", "counted"})
    store_->delete_key(key(round, k));
}

bool Rendezvous::any_done(const Round& r) {
  for (int i = 0; i < r.nnodes; ++i)
    if (store_->check({key(r.number, "done/" + std::to_string(i))})) return true;
  return false;
}

int Rendezvous::restarts_used() { return static_cast<int>(store_->add("restarts_used", 0)); }

// The round's end is one key whose first writer decides: "F<reason>" for a
// failure, "S<reason>" for a scale-up.
RoundEnd Rendezvous::end_round(int round, const RoundEnd& end) {
  const std::string value = (end.scale_up ? "S" : "F") + end.reason;
  store_->compare_set(key(round, "failed"), {}, {value.begin(), value.end()});
  return *ended(round);
}

std::optional<RoundEnd> Rendezvous::ended(int round) {
  if (!store_->check({key(round, "failed")})) return std::nullopt;
  const std::string value = store_->get_string(key(round, "failed"));
  if (value.empty()) return RoundEnd{false, "(no reason given)"};
  return RoundEnd{value[0] == 'S', value.substr(1)};
}

void Rendezvous::wait_for_next_round(int round, int participants) {
  const auto& o = options_;
  store_->add(key(round, "waiting"), 1);
  std::cerr << "dtrain-run: round " << round << " of rendezvous '" << o.rdzv_id << "' is running with "
            << participants << " node(s) (max " << o.max_nodes
            << "); waiting for the running nodes to start the next round with this one" << std::endl;
  const auto deadline = Clock::now() + o.join_timeout;
  while (current_round() <= round) {
    throw_if_signalled();
    if (Clock::now() > deadline) {
      std::ostringstream msg;
      msg << "rendezvous '" << o.rdzv_id << "' at " << endpoint() << ": waited "
          << o.join_timeout.count() / 1000.0 << " s for the " << participants
          << " running node(s) to make room in a new round";
      throw TimeoutError(msg.str());
    }
    std::this_thread::sleep_for(kPoll);
  }
}

int Rendezvous::round_with_room(int number) {
  const auto& o = options_;
  for (;;) {
    const int participants = store_->check({key(number, "closed")})
                                 ? std::stoi(store_->get_string(key(number, "closed")))
                                 : -1;
    // A round that closed without room for this node ends it (error below);
    // one with room makes this node wait for the next.
    if (!o.elastic() || participants < 0 || participants >= o.max_nodes) return number;
    if (store_->check({key(number, "done/0")}) || ended(number)) {  // over, or ending
      number = std::max(number + 1, current_round());  // that round is over: take the next
      continue;
    }
    wait_for_next_round(number, participants);
    number = current_round();
  }
}

// Static: every node's rank is given; waits for all of them. Returns the
// number of nodes.
int Rendezvous::join_static(int number, const std::string& me) {
  const auto& o = options_;
  store_->set(key(number, "node/" + std::to_string(o.node_rank)), me);
  const int participants = o.max_nodes;
  std::vector<std::string> keys;
  for (int i = 0; i < participants; ++i) keys.push_back(key(number, "node/" + std::to_string(i)));
  try {
    wait_keys(keys, o.join_timeout);
  } catch (const TimeoutError&) {
    std::vector<std::string> missing;
    for (int i = 0; i < participants; ++i)
      if (!store_->check({keys[i]})) missing.push_back(std::to_string(i));
    std::ostringstream msg;
    msg << "rendezvous at " << endpoint() << " (round " << number << "): timed out after "
        << o.join_timeout.count() / 1000.0 << " s waiting for nodes: "
        << participants - static_cast<int>(missing.size()) << "/" << participants
        << " joined (missing node ranks:";
    for (const auto& m : missing) msg << " " << m;
    msg << ")";
    throw TimeoutError(msg.str());
  }
  return participants;
}

// Dynamic: nodes take ranks in arrival order until the round closes.
// Returns {nodes, this node's rank}.
std::pair<int, int> Rendezvous::join_dynamic(int number, const std::string& me) {
  const auto& o = options_;
  const auto start = Clock::now();
  int participants = 0;
  const int index = static_cast<int>(store_->add(key(number, "count"), 1)) - 1;
  store_->set(key(number, "node/" + std::to_string(index)), me);
  std::optional<Clock::time_point> reached_min;
  for (;;) {
    throw_if_signalled();
    if (store_->check({key(number, "closed")})) {
      participants = std::stoi(store_->get_string(key(number, "closed")));
      break;
    }
    const int count = static_cast<int>(store_->add(key(number, "count"), 0));
    std::string close_at;
    if (count >= o.max_nodes) {
      close_at = std::to_string(o.max_nodes);
    } else if (count >= o.min_nodes) {
      if (!reached_min) reached_min = Clock::now();
      if (Clock::now() - *reached_min >= o.last_call_timeout) close_at = std::to_string(count);
    }
    if (!close_at.empty()) {
      // Whoever closes first decides the size; everyone reads it back.
      store_->compare_set(key(number, "closed"), {}, {close_at.begin(), close_at.end()});
      continue;
    }
    if (Clock::now() - start > o.join_timeout) {
      std::ostringstream msg;
      msg << "rendezvous '" << o.rdzv_id << "' at " << endpoint() << " (round " << number
          << "): timed out after " << o.join_timeout.count() / 1000.0
          << " s waiting for nodes: " << count << "/" << o.min_nodes << " joined (min "
          << o.min_nodes << ", max " << o.max_nodes << ")";
      throw TimeoutError(msg.str());
    }
    std::this_thread::sleep_for(kPoll);  // the store has no "wait for count" primitive
  }
  if (index >= participants)
    throw Error("rendezvous '" + o.rdzv_id + "' at " + endpoint() + ": round " +
                std::to_string(number) + " closed with " + std::to_string(participants) +
                " node(s), the maximum (--nnodes " + std::to_string(o.min_nodes) + ":" +
                std::to_string(o.max_nodes) + "), before this node joined");
  return {participants, index};
}

// Node table: the workers of every participant, in node order. A node
// that took a place (join_dynamic's count) writes its entry a moment later;
// one that died in between would leave the others waiting, so the wait is
// bounded by the join timeout and stops on a signal. Entries come from
// other launchers through the store: each is checked.
std::vector<int> Rendezvous::node_table(int number, int participants) {
  const auto& o = options_;
  std::vector<std::string> keys;
  for (int i = 0; i < participants; ++i) keys.push_back(key(number, "node/" + std::to_string(i)));
  try {
    wait_keys(keys, o.join_timeout);
  } catch (const TimeoutError&) {
    std::string missing;
    for (int i = 0; i < participants; ++i)
      if (!store_->check({keys[i]})) missing += (missing.empty() ? "" : ", ") + std::to_string(i);
    std::ostringstream msg;
    msg << "rendezvous '" << o.rdzv_id << "' at " << endpoint() << " (round " << number
        << "): node(s) " << missing << " took a place in the round but did not write their "
        << "address within " << o.join_timeout.count() / 1000.0
        << " s (did their launchers die while joining?)";
    throw TimeoutError(msg.str());
  }
  std::vector<int> nprocs(participants);
  for (int i = 0; i < participants; ++i) {
    const auto entry = store_->get_string(keys[i]);
    const auto bar = entry.rfind('|');
    const std::string count = bar == std::string::npos ? "" : entry.substr(bar + 1);
    const bool digits = !count.empty() && count.size() <= 6 &&
                        count.find_first_not_of("0123456789") == std::string::npos;
    nprocs[i] = digits ? std::stoi(count) : 0;
    if (nprocs[i] < 1)
      throw Error("rendezvous '" + o.rdzv_id + "' at " + endpoint() + " (round " +
                  std::to_string(number) + "): node " + std::to_string(i) +
                  "'s entry is not '<address>|<workers>' (" + std::to_string(entry.size()) +
                  " bytes): is another program using this rendezvous id?");
  }
  return nprocs;
}

Round Rendezvous::join(int number) {
  const auto& o = options_;
  number = round_with_room(number);
  Round r;
  r.number = number;
  const std::string me = local_address_ + "|" + std::to_string(o.nproc_per_node);
  int participants = 0;
  if (o.elastic()) {
    std::tie(participants, r.node_rank) = join_dynamic(number, me);
  } else {
    participants = join_static(number, me);
    r.node_rank = o.node_rank;
  }
  r.nnodes = participants;
  const std::vector<int> nprocs = node_table(number, participants);
  if (r.node_rank == 0) prune(number - 2);
  r.rank_offset = 0;
  for (int i = 0; i < r.node_rank; ++i) r.rank_offset += nprocs[i];
  r.world_size = 0;
  for (int n : nprocs) r.world_size += n;
  // torchrun's contract: the workers use this launcher store as clients
  // (TORCHELASTIC_USE_AGENT_STORE=True) on the one port the user named; it
  // speaks c10d's protocol too, so PyTorch programs can use it as well.
  r.master_addr = store_host_;
  r.master_port = store_port_;
  // keep-alive state for this round
  last_seen_.assign(participants, -1);
  stale_checks_.assign(participants, 0);
  next_beat_ = Clock::now();
  return r;
}

std::optional<RoundEnd> Rendezvous::check(const Round& r) {
  if (auto end = ended(r.number)) return end;
  // Room for more nodes, and none has finished (a job that is ending is not
  // restarted for a newcomer).
  if (options_.elastic() && r.nnodes < options_.max_nodes && !any_done(r)) {
    const int64_t waiting = store_->add(key(r.number, "waiting"), 0);
    if (waiting > 0)
      return end_round(r.number, RoundEnd{true, std::to_string(waiting) + " node(s) waiting to join"});
  }
  if (Clock::now() < next_beat_) return std::nullopt;
  next_beat_ = Clock::now() + options_.keep_alive_interval;
  store_->set(key(r.number, "alive/" + std::to_string(r.node_rank)), std::to_string(++beats_));
  for (int i = 0; i < r.nnodes; ++i) {
    if (i == r.node_rank || store_->check({key(r.number, "done/" + std::to_string(i))})) continue;
    const auto k = key(r.number, "alive/" + std::to_string(i));
    const int64_t seen = store_->check({k}) ? std::stoll(store_->get_string(k)) : 0;
    stale_checks_[i] = seen == last_seen_[i] ? stale_checks_[i] + 1 : 0;
    last_seen_[i] = seen;
    if (stale_checks_[i] > options_.keep_alive_max_attempt) {
      std::string reason = "node " + std::to_string(i) + " stopped sending keep-alives for " +
                           std::to_string(stale_checks_[i] * options_.keep_alive_interval.count() / 1000.0) +
                           " s (its launcher died or lost the network)";
      return report_failure(r, reason);
    }
  }
  return std::nullopt;
}

RoundEnd Rendezvous::report_failure(const Round& r, const std::string& reason) {
  return end_round(r.number, RoundEnd{false, reason});
}

void Rendezvous::report_done(const Round& r) {
  store_->set(key(r.number, "done/" + std::to_string(r.node_rank)), "1");
}

bool Rendezvous::wait_for_others(const Round& r) {
  // As long as the others are alive (keep-alives move), they may still be
  // training; a failure or a silent node ends the wait.
  for (;;) {
    throw_if_signalled();
    bool all = true;
    for (int i = 0; i < r.nnodes && all; ++i)
      all = store_->check({key(r.number, "done/" + std::to_string(i))});
    if (all) return true;
    if (auto end = check(r); end && !end->scale_up) return false;
    std::this_thread::sleep_for(kPoll);
  }
}

}  // namespace dtrain::run
