// The fault-tolerance Manager (dtrain/ft/manager.h). A step's quorum runs
// as a "round": the replica's first rank asks the lighthouse and hands the
// answer to the replica's other ranks through the replica's store; each
// rank then builds its cross-replica group when the quorum's id changed
// and sends or receives a healing state. Nothing of a round throws out
// of the Manager's calls but bad input (a refusal): a failed round marks
// the step.

#include "dtrain/ft/manager.h"

#include <ATen/ATen.h>

#include <future>
#include <mutex>
#include <optional>
#include <random>

#include "checkpoint/checkpointer.h"
#include "checkpoint/storage/peer/peer.h"
#include "common/decimal.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/socket.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/distributed.h"
#include "dtrain/store/tcp_store.h"
#include "ft/abandonable_store.h"
#include "ft/lighthouse_link.h"
#include "ft/quorum_rule.h"
#include "ft/state_fingerprint.h"

namespace dtrain::ft {
namespace {

// What the replica's first rank hands to the others for a round: "ok\n"
// and the lighthouse's answer, or "failed <why>" when it got none.
constexpr char kOk[] = "ok\n";
// The manager's own entry in a healing part's metadata.
constexpr char kSamplesKey[] = "dtrain_ft/committed_samples";
constexpr char kFailed[] = "failed ";

int64_t random_nonce() {
  std::random_device device;
  return std::uniform_int_distribution<int64_t>(1, INT64_MAX)(device);
}

}  // namespace

struct Manager::Impl {
  Impl(checkpoint::DistributedState& s, ManagerOptions o) : state(s), options(std::move(o)) {}
  checkpoint::DistributedState& state;
  ManagerOptions options;
  std::shared_ptr<ProcessGroup> group;  // null: this process alone
  std::shared_ptr<Store> replica_store;
  int rank = 0, world = 1;
  std::string replica;
  std::string layout;
  std::string incarnation;   // this start of the replica (hex), the same on its ranks
  std::string round_prefix;  // the replica's keys for handing quorums over
  std::unique_ptr<LighthouseLink> link;
  std::unique_ptr<Heartbeat> heartbeat;
  std::string local_address;

  int64_t step = 0;
  int64_t samples = 0;       // committed (step_samples' blocks)
  int64_t step_block = 0;    // this step's block, added to `samples` on a commit
  int64_t round = 0;
  bool rebuild = false;  // the last step did not commit
  std::string lineage;   // the quorum that committed `step` (protocol::Request::lineage)
  std::shared_future<void> round_done;

  mutable std::mutex mutex;  // what a round sets, read by other threads
  std::exception_ptr error;   // this step's first
  std::exception_ptr refusal;  // bad input the lighthouse found: thrown
  std::optional<QuorumView> view;
  std::vector<std::string> members;
  std::shared_ptr<ProcessGroup> peers;
  std::shared_ptr<Store> peers_store;  // its rendezvous store (served here by the place's first member)
  std::string peers_quorum;
  std::string published;  // the lighthouse's key of a rendezvous store being served
  std::optional<checkpoint::storage::Loaded> healed;  // to load before committing
  // The lighthouse's verdict: members of this quorum are dead (its groups
  // aborted, its rendezvous given up), and why.
  std::string doomed_quorum, doomed_reason;
  bool aborted = false;  // a group was aborted since the last request: ask for new ones
  // Declared last, so destroyed first: its thread calls on_deaths.
  std::unique_ptr<DeathWatch> watch;

  void report(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!error) error = std::move(e);
  }

  // The lighthouse declared members of quorum `q` dead: this rank's group
  // of it is aborted (its operations in flight fail now, not at their
  // timeout) and a rendezvous for it is given up.
  void on_deaths(const std::string& q, const std::vector<protocol::Death>& deaths) {
    const std::string why = detail::cat("the lighthouse declared ", protocol::describe(deaths), " dead in quorum ", q);
    std::shared_ptr<ProcessGroup> g;
    {
      std::lock_guard<std::mutex> lock(mutex);
      doomed_quorum = q;
      doomed_reason = why;
      if (peers && peers_quorum == q) {
        g = peers;
        aborted = true;
      }
      if (view && view->quorum_id == q && !error) error = std::make_exception_ptr(NetworkError(what(why.c_str())));
    }
    if (g) g->abort(why);
  }

  std::string abandoned(const std::string& q) {
    std::lock_guard<std::mutex> lock(mutex);
    return doomed_quorum == q ? doomed_reason : "";
  }

  std::string what(const char* doing) const {
    return detail::cat("ft::Manager (replica '", replica, "', rank ", rank, "/", world, "): ", doing);
  }

  // The answer of this round: asked by the first rank, handed to the others.
  protocol::Answer obtain_answer(int64_t r) {
    const std::string key = detail::cat(round_prefix, r);
    std::string handed;
    if (rank == 0) {
      bool new_groups = rebuild;
      {
        std::lock_guard<std::mutex> lock(mutex);
        new_groups = new_groups || aborted;
        aborted = false;
      }
      try {
        auto answer = link->ask(protocol::Request{replica, step, world, layout, new_groups, incarnation, lineage},
                                options.connect_timeout(), options.quorum_timeout());
        handed = kOk + protocol::encode(answer);
      } catch (const std::exception& e) {
        link->reset();
        handed = kFailed + std::string(e.what());
      }
      if (world > 1) {
        replica_store->set(key, handed);
        if (r > 2) replica_store->delete_key(detail::cat(round_prefix, r - 2));
      }
    } else {
      replica_store->wait({key}, options.quorum_timeout() + options.connect_timeout() + options.timeout());
      handed = replica_store->get_string(key);
    }
    if (handed.rfind(kFailed, 0) == 0) throw NetworkError(handed.substr(sizeof kFailed - 1));
    auto answer = protocol::parse_answer(handed.substr(sizeof kOk - 1));
    if (!answer.error.empty()) {
      std::lock_guard<std::mutex> lock(mutex);
      refusal = std::make_exception_ptr(InvalidArgument(what("the lighthouse refused this replica: ") + answer.error));
      std::rethrow_exception(refusal);
    }
    return answer;
  }

  // This rank's cross-replica group of the quorum `v`: kept while the
  // quorum's id is the same, else built anew in the lighthouse's store.
  // Where a cross-replica group of `v` rendezvous: a store the place's
  // first member serves for as long as the group lives, its address in the
  // lighthouse's store under one key (deleted once the group is built), so
  // that the lighthouse keeps nothing of a group after it (a thousand
  // rebuilds leave its memory as it was).
  std::shared_ptr<Store> rendezvous_store(const QuorumView& v) {
    auto given_up = [this, q = v.quorum_id] { return abandoned(q); };
    auto abandonable = [&](std::shared_ptr<Store> s) {
      return std::make_shared<AbandonableStore>(std::move(s), given_up, options.heartbeat_interval());
    };
    auto lighthouse = abandonable(link->store(options.connect_timeout()));
    const std::string key = detail::cat("ft/group/", v.quorum_id, "/", rank);
    if (v.replica_rank == 0) {
      const std::string host = local_address.empty() ? net::interface_address(*env::get(env::kSocketIfname))
                                                     : local_address;
      auto server = std::make_shared<TcpStore>(TcpStoreOptions()
                                                   .host(host)
                                                   .port(0)
                                                   .is_server(true)
                                                   .wait_workers(false)
                                                   .timeout(options.timeout())
                                                   .token(options.token()));
      lighthouse->set(key, net::endpoint(host, server->port()));
      published = key;
      return abandonable(server);
    }
    lighthouse->wait({key}, options.timeout());
    const auto at = parse_lighthouse_address(lighthouse->get_string(key), "the group's rendezvous store");
    return abandonable(std::make_shared<TcpStore>(
        TcpStoreOptions().host(at.host).port(at.port).timeout(options.timeout()).token(options.token())));
  }

  std::shared_ptr<ProcessGroup> peers_of(const QuorumView& v) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (peers && peers_quorum == v.quorum_id) return peers;
      peers.reset();  // the old group's sockets close before new ones open
      peers_store.reset();
      peers_quorum.clear();
    }
    watch->watch(v.quorum_id);
    auto store = rendezvous_store(v);
    auto g = create_process_group(options.backend(), store, v.replica_rank, v.replica_world,
                                  GroupOptions()
                                      .name(detail::cat("ft/", rank, "@", v.quorum_id))
                                      .timeout(options.timeout())
                                      .local_address(local_address));
    if (!published.empty()) {  // every member has joined: the address is not needed any more
      link->store(options.connect_timeout())->delete_key(published);
      published.clear();
    }
    std::lock_guard<std::mutex> lock(mutex);
    peers = g;
    peers_store = store;
    peers_quorum = v.quorum_id;
    return g;
  }

  // Heals from, or for, the quorum's members (tag 0 of the cross group).
  void heal(const QuorumView& v, ProcessGroup& g) {
    if (!v.heal_targets.empty()) {
      auto sent = state;  // the same tensors, and the manager's own count
      sent.metadata[kSamplesKey] = std::to_string(samples);
      for (int target : v.heal_targets)
        checkpoint::storage::peer::send_state(sent, step, rank, world, g, target, 0);
    }
    if (!v.healing()) return;
    checkpoint::storage::peer::Reader reader(
        g, v.heal_source, 0, v.max_step, rank, world,
        detail::cat("ft::Manager: healing replica '", replica, "' rank ", rank, " from replica ",
                    v.heal_source, " of quorum ", v.quorum_id));
    auto loaded = reader.read(state);
    std::lock_guard<std::mutex> lock(mutex);
    healed = std::move(loaded);
  }

  void run_round(int64_t r) {
    try {
      auto answer = obtain_answer(r);
      auto v = view_of(answer, replica, options.init_sync(), options.async_quorum(),
                       options.world_size_mode() == WorldSizeMode::kFixedWithSpares ? options.min_replicas() : 0);
      {
        std::lock_guard<std::mutex> lock(mutex);
        view = v;
        members.clear();
        for (const auto& m : answer.members) members.push_back(m.replica);
      }
      auto g = peers_of(v);
      heal(v, *g);
    } catch (...) {
      report(std::current_exception());
    }
  }

  // The healed state goes in (a checkpoint load: fills, metadata, hooks).
  void apply_healed() {
    std::optional<checkpoint::storage::Loaded> loaded;
    int64_t to_step = 0;
    std::string to_lineage;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!healed || error) return;
      loaded = std::move(healed);
      healed.reset();
      to_step = view->max_step;
      to_lineage = view->lineage;
    }
    struct Ready : checkpoint::storage::Reader {
      std::optional<checkpoint::storage::Loaded> value;
      std::optional<checkpoint::storage::Loaded> read(const checkpoint::DistributedState&) override {
        return std::move(value);
      }
    } ready;
    int64_t taken_samples = 0;
    if (loaded->metadata) {
      auto it = loaded->metadata->find(kSamplesKey);
      DTRAIN_CHECK_ARG(it != loaded->metadata->end(), what("the healing part has no "), kSamplesKey);
      const auto count = dtrain::detail::parse_decimal(it->second);
      DTRAIN_CHECK_ARG(count.has_value(), what("the healing part's "), kSamplesKey, " '", it->second,
                       "' is not a count");
      taken_samples = *count;
      loaded->metadata->erase(it);
    }
    ready.value = std::move(loaded);
    checkpoint::load_state(ready, state);
    step = to_step;
    lineage = to_lineage;
    samples = taken_samples;
  }

  void wait_round() {
    if (round_done.valid()) round_done.get();
  }

  void throw_refusal() {
    std::lock_guard<std::mutex> lock(mutex);
    if (refusal) std::rethrow_exception(refusal);
  }

  // MIN of `ok` over `g`; false when the vote itself fails.
  static bool vote(ProcessGroup& g, bool ok) {
    auto t = at::full({1}, ok ? 1 : 0, at::kInt);
    g.all_reduce(t, ReduceOp::MIN)->wait();
    return t.item<int>() == 1;
  }
};

Manager::Manager(checkpoint::DistributedState& state, ManagerOptions options)
    : impl_(std::make_unique<Impl>(state, std::move(options))) {
  auto& m = *impl_;
  auto& o = m.options;
  if (o.replica_id().empty()) o.replica_id(env::get(env::kFtReplicaId).value_or(""));
  if (o.lighthouse().empty()) o.lighthouse(env::get(env::kFtLighthouse).value_or(""));
  DTRAIN_CHECK_ARG(!o.replica_id().empty(), "ft::Manager: no replica id (set ManagerOptions::replica_id or ",
                   env::kFtReplicaId.name, ")");
  protocol::check_replica_id(o.replica_id(), "ft::Manager");
  DTRAIN_CHECK_ARG(!o.lighthouse().empty(), "ft::Manager: no lighthouse (set ManagerOptions::lighthouse or ",
                   env::kFtLighthouse.name, ")");
  DTRAIN_CHECK_ARG(o.min_replicas() >= 1, "ft::Manager: min_replicas is ", o.min_replicas(), " (at least 1)");
  m.replica = o.replica_id();
  m.group = o.group() ? o.group() : (is_initialized() ? default_group() : nullptr);
  m.rank = m.group ? m.group->rank() : 0;
  m.world = m.group ? m.group->size() : 1;
  DTRAIN_CHECK_ARG(m.rank >= 0, "ft::Manager: this rank is not a member of the replica's group");
  // This start of the replica, the same on its ranks: the lighthouse tells
  // it from its previous processes, and its keys in the replica's store are
  // not those its previous processes left there.
  auto nonce = at::full({1}, random_nonce(), at::kLong);
  if (m.world > 1) {
    DTRAIN_CHECK_ARG(o.store() || is_initialized(),
                     "ft::Manager: a replica of ", m.world, " ranks needs a store (ManagerOptions::store, or "
                     "init_process_group's)");
    m.replica_store = o.store() ? o.store() : default_store();
    m.group->broadcast(nonce, 0)->wait();
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(nonce.item<int64_t>()));
  m.incarnation = hex;
  m.round_prefix = detail::cat("dtrain_ft/", m.replica, "/", m.incarnation, "/quorum/");
  const auto address = parse_lighthouse_address(o.lighthouse(), "ft::Manager: the lighthouse");
  m.local_address = env::get(env::kSocketIfname) ? "" : net::local_address_towards(address.host);
  m.link = std::make_unique<LighthouseLink>(address, o.token(), o.timeout());
  m.link->store(o.connect_timeout());  // unreachable, refused or not a lighthouse: thrown here
  if (m.rank == 0) m.heartbeat = std::make_unique<Heartbeat>(address, o.token(), m.replica, o.heartbeat_interval());
  m.watch = std::make_unique<DeathWatch>(
      address, o.token(), o.heartbeat_interval(),
      [&m](const std::string& q, const std::vector<protocol::Death>& deaths) { m.on_deaths(q, deaths); });
}

Manager::~Manager() {
  try {
    impl_->wait_round();
  } catch (...) {
  }
}

void Manager::start_quorum() {
  auto& m = *impl_;
  m.wait_round();  // a round not waited for (no allreduce, no should_commit) ends first
  m.throw_refusal();
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.error = nullptr;
    m.view.reset();
    m.healed.reset();
  }
  // The state may be filled after construction (FT-HSDP: the FSDP model
  // needs the manager first); the job's layout is what it holds now.
  if (m.layout.empty()) m.layout = state_fingerprint(m.state);
  const int64_t r = ++m.round;
  if (m.options.async_quorum()) {
    m.round_done = std::async(std::launch::async, [&m, r] { m.run_round(r); }).share();
    return;
  }
  m.run_round(r);
  m.throw_refusal();
  m.apply_healed();
}

void Manager::allreduce(at::Tensor tensor) { allreduce_async(std::move(tensor))->wait(); }

WorkPtr Manager::allreduce_async(at::Tensor tensor) {
  auto& m = *impl_;
  m.wait_round();
  std::shared_ptr<ProcessGroup> g;
  QuorumView v;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    if (m.error || !m.view || !m.peers) return Work::completed("ft::Manager::allreduce (the step has failed)");
    g = m.peers;
    v = *m.view;
  }
  try {
    DTRAIN_CHECK_ARG(tensor.device().is_cpu(), m.what("allreduce takes CPU tensors; this one is on "),
                     tensor.device());
    if (v.participant < 0) tensor.zero_();  // healing asynchronously, or a spare
    if (v.participants > 1) tensor.div_(v.participants);
    auto inner = g->all_reduce(tensor);
    auto done = std::make_shared<Work>("ft::Manager::allreduce over " + g->name());
    inner->on_finish([&m, done](const std::exception_ptr& e) {
      if (e) m.report(e);
      done->finish();
    });
    return done;
  } catch (...) {
    m.report(std::current_exception());
    return Work::completed("ft::Manager::allreduce (failed)");
  }
}

bool Manager::should_commit() {
  auto& m = *impl_;
  m.wait_round();
  m.throw_refusal();
  try {
    m.apply_healed();
  } catch (...) {
    m.report(std::current_exception());
  }
  std::shared_ptr<ProcessGroup> g;
  bool ok;
  std::string quorum_id;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    ok = !m.error && m.view && m.view->replica_world >= m.options.min_replicas();
    if (m.view) quorum_id = m.view->quorum_id;
    // Only this round's group: another quorum's members vote elsewhere.
    if (m.view && m.peers_quorum == m.view->quorum_id) g = m.peers;
  }
  if (g) {  // every member's ranks of this place agree ...
    try {
      ok = Impl::vote(*g, ok);
    } catch (...) {
      m.report(std::current_exception());
      ok = false;
    }
  }
  if (m.group && m.world > 1) ok = Impl::vote(*m.group, ok);  // ... and every place of this replica
  if (ok) {
    ++m.step;
    m.samples += m.step_block;
    m.lineage = quorum_id;
  }
  m.step_block = 0;
  m.rebuild = !ok;
  return ok;
}

StepSamples Manager::step_samples(int64_t per_rank) {
  auto& m = *impl_;
  DTRAIN_CHECK_ARG(!m.options.async_quorum(),
                   m.what("step_samples needs ManagerOptions().async_quorum(false): with an asynchronous quorum a "
                          "healing replica's share of a step is not trained"));
  DTRAIN_CHECK_ARG(per_rank > 0, m.what("step_samples: per_rank is "), per_rank, " (at least 1)");
  m.wait_round();
  int participants = 1, participant = 0;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    if (m.view && !m.error) participants = m.view->participants, participant = m.view->participant;
  }
  // Without a quorum the step will not commit: any block will do.
  StepSamples s;
  s.step_first = m.samples;
  s.step_count = per_rank * m.world * participants;
  if (participant >= 0) {
    s.first = m.samples + per_rank * (static_cast<int64_t>(participant) * m.world + m.rank);
    s.count = per_rank;
  } else {  // a spare: none of the step's samples
    s.first = s.step_first + s.step_count;
    s.count = 0;
  }
  m.step_block = s.step_count;
  return s;
}

int64_t Manager::committed_samples() const { return impl_->samples; }

void Manager::report_error(std::exception_ptr error) { impl_->report(std::move(error)); }

std::exception_ptr Manager::errored() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->error;
}

int64_t Manager::current_step() const { return impl_->step; }

int Manager::num_participants() {
  impl_->wait_round();
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->view && !impl_->error ? impl_->view->participants : 0;
}

bool Manager::is_participating() {
  impl_->wait_round();
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->view && !impl_->error && impl_->view->participant >= 0;
}

const ManagerOptions& Manager::options() const { return impl_->options; }

QuorumInfo Manager::quorum() {
  impl_->wait_round();
  std::lock_guard<std::mutex> lock(impl_->mutex);
  QuorumInfo q;
  if (!impl_->view) return q;
  const auto& v = *impl_->view;
  q.id = v.quorum_id;
  q.members = impl_->members;
  q.replica_rank = v.replica_rank;
  q.max_step = v.max_step;
  q.participants = v.participants;
  q.participating = v.participant >= 0;
  q.healing = v.healing();
  return q;
}

ProcessGroup& Manager::replica_group() const {
  DTRAIN_CHECK_ARG(impl_->group != nullptr, impl_->what("this replica is one process: it has no group"));
  return *impl_->group;
}

std::shared_ptr<ProcessGroup> Manager::replica_peers() {
  impl_->wait_round();
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->peers;
}

std::function<WorkPtr(at::Tensor)> replicate_average(Manager& manager) {
  return [&manager](at::Tensor shard_grad) { return manager.allreduce_async(std::move(shard_grad)); };
}

CommHook allreduce_hook(Manager& manager) {
  return [&manager](ProcessGroup& group, GradBucket& bucket) {
    bucket.buffer.div_(bucket.divisor);
    if (group.size() > 1) group.all_reduce(bucket.buffer)->wait();
    manager.allreduce(bucket.buffer);
  };
}

}  // namespace dtrain::ft
