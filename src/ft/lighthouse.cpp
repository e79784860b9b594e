// The lighthouse (dtrain/ft/lighthouse.h): a TCP store and one thread that
// reads the replicas' requests and heartbeats from it every tick, forms
// quorums (quorum_rule.h) and writes the answers back.

#include "dtrain/ft/lighthouse.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "common/enforce.h"
#include "common/logging.h"
#include "common/socket.h"
#include "dtrain/store/tcp_store.h"
#include "ft/protocol.h"
#include "ft/quorum_rule.h"

namespace dtrain::ft {
namespace {

// A request number taken (ft/requests) whose request never came (its
// replica died between the two calls) is skipped after this long.
constexpr std::chrono::seconds kLostRequestGrace{2};

std::string new_incarnation() {
  std::random_device device;
  std::uniform_int_distribution<uint64_t> any;
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(any(device)));
  return std::string(text, 8);  // ids stay short; two lighthouses of a job need only differ
}

}  // namespace

struct Lighthouse::Impl {
  LighthouseOptions options;
  std::unique_ptr<TcpStore> store;
  std::string incarnation = new_incarnation();

  struct Known {
    int64_t beats = -1;
    Clock::time_point last_change;
    bool present = false;  // its presence key was seen
    bool gone = false;     // ... and then went: its heartbeat connection closed
  };
  struct Asking {
    protocol::Request request;
    int64_t n = 0;
    Clock::time_point since;
  };
  std::map<std::string, Known> known;
  std::map<std::string, Asking> asking;
  std::set<std::string> previous;
  std::map<std::string, std::string> previous_incarnations;
  std::string previous_id;
  std::map<std::string, protocol::Death> declared;  // members of previous_id declared dead
  int64_t formed = 0;
  std::optional<protocol::Request> job_layout;  // the first request's

  mutable std::mutex status_mutex;
  LighthouseStatus status;
  std::atomic<bool> stop{false};
  std::thread thread;

  void answer(int64_t n, const protocol::Answer& a) {
    store->set(protocol::answer_key(n), protocol::encode(a));
    std::lock_guard<std::mutex> lock(status_mutex);
    ++(a.error.empty() ? status.quorums : status.refused);
  }

  void refuse(int64_t n, const std::string& why) { answer(n, protocol::Answer{why, "", {}}); }

  // Another layout than the job's: refused, naming both.
  std::string layout_mismatch(const protocol::Request& r) const {
    const auto& j = *job_layout;
    if (r.world == j.world && r.layout == j.layout) return "";
    return detail::cat("replica '", r.replica, "' has ", r.world, " ranks and state fingerprint ", r.layout,
                       "; the job's replicas have ", j.world, " ranks and state fingerprint ", j.layout,
                       " (as replica '", j.replica, "' first asked): ",
                       r.world != j.world ? "another world size" : "another model or optimizer layout");
  }

  void take(int64_t n, const std::string& text, Clock::time_point now) {
    protocol::Request r;
    try {
      r = protocol::parse_request(text);
    } catch (const InvalidArgument& e) {
      return refuse(n, e.what());
    }
    if (!job_layout) job_layout = r;
    if (auto why = layout_mismatch(r); !why.empty()) return refuse(n, why);
    // A request is a sign of life, as a heartbeat is: a replica whose
    // heartbeat thread is held up (a process starting on a busy host) is
    // not taken for dead while it asks.
    known[r.replica].last_change = now;
    auto it = asking.find(r.replica);
    if (it != asking.end()) refuse(it->second.n, "superseded by a newer request of the same replica");
    asking[r.replica] = Asking{r, n, now};
  }

  // A queue in the store: a counter that hands out numbers and a key per
  // number. A number taken whose key never came (its replica died between
  // the two calls) is skipped after kLostRequestGrace.
  struct Queue {
    const char* counter;
    std::string (*key)(int64_t);
    int64_t next = 1;
    Clock::time_point missing_since{};
  };
  Queue requests{protocol::kRequestsKey, protocol::request_key};
  Queue registrations{protocol::kRegistrationsKey, protocol::registration_key};

  template <typename Take>
  void drain(Queue& q, Clock::time_point now, Take&& take) {
    for (;;) {
      const std::string key = q.key(q.next);
      if (store->check({key})) {
        const std::string text = store->get_string(key);
        store->delete_key(key);
        take(q.next++, text);
        q.missing_since = {};
        continue;
      }
      if (store->add(q.counter, 0) < q.next) return;
      if (q.missing_since == Clock::time_point{}) q.missing_since = now;
      if (now - q.missing_since < kLostRequestGrace) return;
      ++q.next;
      q.missing_since = {};
    }
  }

  void read_queues(Clock::time_point now) {
    drain(registrations, now, [&](int64_t, const std::string& id) {
      try {
        protocol::check_replica_id(id, "registration");
      } catch (const InvalidArgument&) {
        return;  // not a replica's: nothing to answer
      }
      auto& k = known[id];
      if (k.beats < 0) k.last_change = now;
    });
    drain(requests, now, [&](int64_t n, const std::string& text) { take(n, text, now); });
  }

  // Live: a heartbeat within the timeout, and its presence key not gone
  // (the store deletes it when the heartbeat's connection closes: a
  // process that ended is known at the next tick, not after the timeout).
  // A replica silent for ten timeouts that is neither asking nor in the
  // last quorum is forgotten (its counter key too): replicas that come and
  // go under new ids (a pod's name) cost the lighthouse nothing once gone.
  std::set<std::string> read_heartbeats(Clock::time_point now) {
    std::set<std::string> live;
    for (auto it = known.begin(); it != known.end();) {
      auto& [id, k] = *it;
      if (store->check({protocol::present_key(id)})) {
        k.present = true;
        k.gone = false;
      } else if (k.present) {
        k.present = false;
        k.gone = true;
      }
      const int64_t beats = store->add(protocol::heartbeat_key(id), 0);
      if (beats != k.beats) {
        k.beats = beats;
        k.last_change = now;
      }
      if (!k.gone && now - k.last_change < options.heartbeat_timeout()) live.insert(id);
      if (now - k.last_change >= 10 * options.heartbeat_timeout() && !asking.count(id) && !previous.count(id)) {
        store->delete_key(protocol::heartbeat_key(id));
        it = known.erase(it);
        continue;
      }
      ++it;
    }
    std::lock_guard<std::mutex> lock(status_mutex);
    status.replicas = static_cast<int64_t>(known.size());
    return live;
  }

  // Members at the quorum's highest step that committed it in different
  // quorums: a replica was declared dead while it went on alone. They are
  // made one by their lineage (view_of); the operator hears of it.
  static void warn_of_fork(const protocol::Answer& a) {
    int64_t top = 0;
    for (const auto& m : a.members) top = std::max(top, m.step);
    std::set<std::string> lineages;
    std::string who;
    for (const auto& m : a.members)
      if (m.step == top) {
        lineages.insert(m.lineage);
        who += detail::cat(who.empty() ? "" : ", ", m.replica, " (", m.lineage.empty() ? "unknown" : m.lineage, ")");
      }
    if (lineages.size() > 1 && top > 0)
      log_warning(detail::cat("dtrain lighthouse: quorum ", a.quorum_id, ": the histories forked before step ", top,
                              ": ", who, " committed it in different quorums; the members of one history heal "
                              "from the other (docs/fault-tolerance.md)"));
  }

  // The id stays only for the same processes of the same members, none
  // of which asks for new groups.
  void form(const std::set<std::string>& members) {
    bool same = members == previous && !previous_id.empty();
    std::map<std::string, std::string> incarnations;
    for (const auto& m : members) {
      const auto& r = asking.at(m).request;
      incarnations[m] = r.incarnation;
      same = same && !r.rebuild;
    }
    same = same && incarnations == previous_incarnations;
    const std::string id = same ? previous_id : detail::cat(incarnation, "-", ++formed);
    protocol::Answer a{"", id, {}};
    for (const auto& m : members) {
      const auto& r = asking.at(m).request;
      a.members.push_back({m, r.step, r.lineage});
    }
    DTRAIN_LOG_INFO("dtrain lighthouse: quorum ", id, ":", [&] {
      std::string text;
      for (const auto& m : a.members)
        text += detail::cat(" ", m.replica, " (step ", m.step, asking.at(m.replica).request.rebuild ? ", rebuild)" : ")");
      return text;
    }());
    warn_of_fork(a);
    // The old quorum's verdict goes before the answers: whoever waited on it
    // has asked since, and a member that reads its answer finds it gone (it
    // was deleted after them, and a member could look in between).
    if (id != previous_id && !declared.empty()) {
      store->delete_key(protocol::dead_key(previous_id));
      declared.clear();
    }
    for (const auto& m : members) {
      answer(asking.at(m).n, a);
      asking.erase(m);
    }
    previous = members;
    previous_incarnations = std::move(incarnations);
    previous_id = id;
    std::lock_guard<std::mutex> lock(status_mutex);
    status.quorum_id = id;
    status.members.assign(members.begin(), members.end());
  }

  // Members of the newest quorum whose heartbeat connection closed or
  // whose heartbeats stopped: named under its verdict key, which every rank
  // of the other members watches (their cross-replica groups of that
  // quorum are aborted). A verdict stands (a member that beats again is
  // still out of that quorum).
  void declare_deaths(const std::set<std::string>& live, Clock::time_point now) {
    if (previous_id.empty()) return;
    int64_t news = 0;
    for (const auto& m : previous) {
      if (live.count(m) || declared.count(m)) continue;
      const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - known[m].last_change);
      const protocol::Death d{m, silent.count(), known[m].gone};
      declared[m] = d;
      ++news;
      log_warning(detail::cat("dtrain lighthouse: quorum ", previous_id, ": ", protocol::describe({d}),
                              ": declared dead"));
    }
    if (news == 0) return;
    std::vector<protocol::Death> deaths;
    for (const auto& [m, d] : declared) deaths.push_back(d);
    store->set(protocol::dead_key(previous_id), protocol::encode(deaths));
    std::lock_guard<std::mutex> lock(status_mutex);
    status.deaths += news;
  }

  void tick() {
    const auto now = Clock::now();
    read_queues(now);
    const auto live = read_heartbeats(now);
    declare_deaths(live, now);
    // An asking replica silent for the heartbeat timeout is left out of
    // quorums but keeps its request (answered if it beats again); one
    // silent for ten is gone, and so is its request. Before, a request was
    // dropped at the first silent tick and never answered: its replica
    // waited out its quorum timeout (60 s), seen under load.
    for (auto it = asking.begin(); it != asking.end();) {
      const auto silent = now - known[it->first].last_change;
      it = silent >= 10 * options.heartbeat_timeout() ? asking.erase(it) : std::next(it);
    }
    QuorumInputs in;
    in.live = live;
    in.previous = previous;
    in.now = now;
    in.first_asked = now;
    for (const auto& [id, a] : asking) {
      if (!live.count(id)) continue;
      in.asking.insert(id);
      in.first_asked = std::min(in.first_asked, a.since);
    }
    if (in.asking.empty()) return;
    in.min_replicas = options.min_replicas();
    in.join_timeout = options.join_timeout();
    if (auto members = decide_quorum(in)) form(*members);
  }

  // Ticks every options.tick, and at once when the next request arrives
  // (a server-side wait on its key): a quorum is answered within a round
  // trip of its last request, not a tick.
  void run() {
    while (!stop.load()) {
      try {
        tick();
      } catch (const std::exception& e) {
        log_warning(detail::cat("dtrain lighthouse: ", e.what()));
      }
      try {
        store->wait({protocol::request_key(requests.next)}, options.tick());
      } catch (const TimeoutError&) {
      } catch (const std::exception&) {
        std::this_thread::sleep_for(options.tick());
      }
    }
  }
};

Lighthouse::Lighthouse(const LighthouseOptions& options) : impl_(std::make_unique<Impl>()) {
  DTRAIN_CHECK_ARG(options.min_replicas() >= 1, "LighthouseOptions: min_replicas is ", options.min_replicas(),
                   " (at least 1)");
  DTRAIN_CHECK_ARG(options.heartbeat_timeout().count() > 0 && options.tick().count() > 0,
                   "LighthouseOptions: heartbeat_timeout and tick must be positive");
  impl_->options = options;
  impl_->store = std::make_unique<TcpStore>(TcpStoreOptions()
                                                .host(options.host())
                                                .port(options.port())
                                                .is_server(true)
                                                .wait_workers(false)
                                                .timeout(std::chrono::seconds(30))
                                                .token(options.token()));
  impl_->store->set(protocol::kIncarnationKey, impl_->incarnation);
  impl_->thread = std::thread([this] { impl_->run(); });
}

Lighthouse::~Lighthouse() {
  impl_->stop = true;
  impl_->thread.join();
}

const std::string& Lighthouse::host() const { return impl_->store->host(); }
uint16_t Lighthouse::port() const { return impl_->store->port(); }
std::string Lighthouse::address() const { return net::endpoint(host(), port()); }

LighthouseStatus Lighthouse::status() const {
  std::lock_guard<std::mutex> lock(impl_->status_mutex);
  return impl_->status;
}

}  // namespace dtrain::ft
