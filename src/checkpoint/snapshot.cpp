// Snapshots in a peer's memory (snapshot.h): the collective halves. Each
// rank talks to its own host's keeper (snapshot_keeper.h) over a Unix
// socket; parts travel between hosts over the group.

#include "dtrain/checkpoint/snapshot.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include <ATen/core/grad_mode.h>

#include "checkpoint/snapshot_part.h"
#include "checkpoint/snapshot_seam.h"
#include "checkpoint/snapshot_transfer.h"
#include "common/enforce.h"
#include "common/env.h"
#include "core/internal_tags.h"
#include "checkpoint/save_plan.h"
#include "world/companion_group.h"
#include "dtrain/distributed.h"
#include "dtrain/objects.h"

namespace dtrain::checkpoint {
namespace snapshot_detail {
namespace {

// The parts are CPU bytes: a group that carries only device tensors (nccl)
// gets a tcp companion of the same ranks, made once.
std::shared_ptr<ProcessGroup> bytes_group(const std::shared_ptr<ProcessGroup>& group) {
  if (group->backend_name() != "nccl") return group;
  static std::mutex mutex;
  static std::map<const ProcessGroup*, std::pair<std::weak_ptr<ProcessGroup>, std::shared_ptr<ProcessGroup>>> made;
  std::lock_guard<std::mutex> lock(mutex);
  auto& entry = made[group.get()];
  if (entry.first.lock() != group || !entry.second)
    entry = {group, dtrain::detail::new_companion_group(*group, "snapshot", "checkpoint::snapshot")};
  return entry.second;
}

// The group's name (at most 256 bytes of it) and its global ranks, run
// lengths of consecutive ranks: "default:0-7", "dp:0,2,4,6" (at most
// 64 runs, then a hash of all): two groups on one host's keeper never
// share a snapshot.
std::string group_key(const ProcessGroup& group) {
  std::string key = group.name().substr(0, 256) + ":";
  const auto& ranks = group.global_ranks();
  std::vector<std::pair<int, int>> runs;
  for (int i = 0; i < group.size(); ++i) {
    const int r = ranks.empty() ? i : ranks[i];
    if (!runs.empty() && runs.back().second + 1 == r) runs.back().second = r;
    else runs.emplace_back(r, r);
  }
  if (runs.size() > 64) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the ranks
    for (const auto& [a, b] : runs)
      for (int r = a; r <= b; ++r) h = (h ^ static_cast<uint64_t>(r)) * 1099511628211ull;
    return key + std::to_string(group.size()) + " ranks #" + std::to_string(h);
  }
  for (size_t i = 0; i < runs.size(); ++i)
    key += (i ? "," : "") + std::to_string(runs[i].first) +
           (runs[i].second > runs[i].first ? "-" + std::to_string(runs[i].second) : "");
  return key;
}

}  // namespace

Context context_of(const SnapshotOptions& o, const std::string& what) {
  Context c;
  c.what = what;
  c.socket = o.keeper_socket();
  if (c.socket.empty()) c.socket = env::get(env::kSnapshotSocket).value_or("");
  DTRAIN_CHECK_ARG(!c.socket.empty(), what, ": no snapshot keeper: run under dtrain-run, which sets ",
                   env::kSnapshotSocket.name, " (or give SnapshotOptions::keeper_socket)");
  c.group = o.process_group() ? o.process_group() : default_group();
  c.bytes = bytes_group(c.group);
  c.rank = c.group->rank();
  c.world = c.group->size();
  c.key = group_key(*c.group);
  return c;
}

namespace {

// Where rank r's second copy goes: the rank of the same local index on the
// next host (hosts told apart by their keepers, in order of first rank);
// -1 when every rank shares one keeper.
int replica_target(const std::vector<uint64_t>& keepers, int r) {
  std::vector<uint64_t> hosts;
  for (auto k : keepers)
    if (std::find(hosts.begin(), hosts.end(), k) == hosts.end()) hosts.push_back(k);
  if (hosts.size() < 2) return -1;
  const size_t here = std::find(hosts.begin(), hosts.end(), keepers[r]) - hosts.begin();
  int local = 0;
  for (int q = 0; q < r; ++q) local += keepers[q] == keepers[r];
  std::vector<int> next;
  for (int q = 0; q < static_cast<int>(keepers.size()); ++q)
    if (keepers[q] == hosts[(here + 1) % hosts.size()]) next.push_back(q);
  return next[local % next.size()];
}

at::Tensor as_bytes(std::string& s) {
  return at::from_blob(s.data(), {static_cast<int64_t>(s.size())}, at::TensorOptions().dtype(at::kByte));
}

// Every rank's failure text ("" for none): the same Error on every rank
// when any is not empty.
template <typename E>
void agree(const Context& c, const std::string& mine) {
  const auto all = all_gather_bytes(mine, CollectiveOptions().group(c.bytes));
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) throw E(c.what + ": rank " + std::to_string(r) + ": " + all[r]);
}

std::atomic<int> commit_refused_on{-1};  // the test seam (checkpoint/snapshot_seam.h)

// The parts travel on a tag of dtrain's own (core/internal_tags.h), issued
// under InternalTraffic: a receive that the user posted ahead on the same
// group cannot take them, nor they the user's messages.
P2POptions part_options(const Context& c) {
  return P2POptions().group(c.bytes).tag(c.bytes->max_tag() - dtrain::detail::kSnapshotTagFromTop);
}

// Sends this rank's part to `to` and receives the parts of `from`, all
// posted at once; sizes first.
std::vector<std::string> exchange(const Context& c, std::string& part, int to, const std::vector<int>& from) {
  const dtrain::detail::InternalTraffic own;
  const P2POptions opts = part_options(c);
  at::Tensor size_out = at::full({1}, static_cast<int64_t>(part.size()), at::kLong);
  std::vector<at::Tensor> sizes_in;
  std::vector<WorkPtr> works;
  if (to >= 0) works.push_back(isend(size_out, c.global(to), opts));
  for (int f : from) {
    sizes_in.push_back(at::zeros({1}, at::kLong));
    works.push_back(irecv(sizes_in.back(), c.global(f), opts));
  }
  for (auto& w : works) w->wait();
  works.clear();
  std::vector<std::string> parts(from.size());
  if (to >= 0 && !part.empty()) works.push_back(isend(as_bytes(part), c.global(to), opts));
  for (size_t i = 0; i < from.size(); ++i) {
    const int64_t n = sizes_in[i].item<int64_t>();
    DTRAIN_CHECK_ARG(n >= 0 && n <= (int64_t{1} << 46), c.what, ": rank ", from[i], " announced a part of ", n, " bytes");
    parts[i].resize(static_cast<size_t>(n));
    if (n > 0) works.push_back(irecv(as_bytes(parts[i]), c.global(from[i]), opts));
  }
  for (auto& w : works) w->wait();
  return parts;
}

// The newest snapshot after `newer_than` whose every part some keeper
// holds, and the holder of each part: the rank itself when its own keeper
// has it, else the first rank whose keeper does. {-1, {}} when none.
std::pair<int64_t, std::vector<int>> newest_complete(const std::vector<wire::Listing>& listings, int64_t newer_than,
                                                     int world) {
  auto holds = [&](int q, int64_t step, int r) {
    const auto& l = listings[q];
    return l.step == step && l.world == static_cast<uint32_t>(world) &&
           std::any_of(l.parts.begin(), l.parts.end(), [&](const auto& p) { return p.first == static_cast<uint32_t>(r); });
  };
  std::vector<int64_t> steps;
  for (const auto& l : listings)
    if (l.step > newer_than && l.world == static_cast<uint32_t>(world)) steps.push_back(l.step);
  std::sort(steps.rbegin(), steps.rend());
  for (int64_t step : steps) {
    std::vector<int> holders(world, -1);
    bool complete = true;
    for (int r = 0; r < world && complete; ++r) {
      for (int q = r; q < world + r && holders[r] < 0; ++q)  // the rank itself first
        if (holds(q % world, step, r)) holders[r] = q % world;
      complete = holders[r] >= 0;
    }
    if (complete) return {step, holders};
  }
  return {-1, {}};
}

uint64_t part_size(const wire::Listing& l, int r) {
  for (const auto& p : l.parts)
    if (p.first == static_cast<uint32_t>(r)) return p.second;
  return 0;
}

// This rank's part of `step`: each holder reads the parts it serves from
// its keeper and sends those of other ranks. A keeper that fails sets
// `failure`; the bytes are still sent (zeros), so that nobody waits.
std::string fetch_part(const Context& c, const std::vector<wire::Listing>& listings, int64_t step,
                       const std::vector<int>& holders, std::string& failure) {
  const dtrain::detail::InternalTraffic own;
  const P2POptions opts = part_options(c);
  std::vector<std::string> served;
  served.reserve(c.world);  // as_bytes views them while they are sent
  std::string mine;
  std::vector<WorkPtr> works;
  for (int r = 0; r < c.world; ++r) {
    if (holders[r] != c.rank) continue;
    const uint64_t size = part_size(listings[c.rank], r);
    std::string bytes;
    try {
      bytes = c.ask(wire::Op::Get, step, r, {}, size);
      if (bytes.size() != size)
        throw Error("the keeper gave " + std::to_string(bytes.size()) + " bytes of rank " + std::to_string(r) +
                    "'s part, not the " + std::to_string(size) + " listed");
    } catch (const Error& e) {
      if (failure.empty()) failure = e.what();
      bytes.assign(size, '\0');
    }
    if (r == c.rank) {
      mine = std::move(bytes);
      continue;
    }
    served.push_back(std::move(bytes));
    if (size > 0) works.push_back(isend(as_bytes(served.back()), c.global(r), opts));
  }
  if (holders[c.rank] != c.rank) {
    mine.resize(part_size(listings[holders[c.rank]], c.rank));
    if (!mine.empty()) works.push_back(irecv(as_bytes(mine), c.global(holders[c.rank]), opts));
  }
  for (auto& w : works) w->wait();
  return mine;
}

// What a rank's part holds of the replicated entries, and what its state
// needs from other parts: "<o|n> <numel> <dtype> <name>" lines.
std::string describe(const snapshot_part::Decoded& d, const DistributedState& state) {
  std::string out;
  auto line = [&](char kind, const std::string& name, const at::Tensor& t) {
    out += std::string(1, kind) + " " + std::to_string(t.numel()) + " " + std::to_string(static_cast<int>(t.scalar_type())) +
           " " + name + "\n";
  };
  for (const auto& [name, t] : d.owned) line('o', name, t);
  for (const auto& name : d.needs) line('n', name, state.replicated.at(name));
  return out;
}

// Every rank's replicated entries from the one part that holds each: after
// the agreement (which `failure`, this rank's problem so far, joins), each
// holder sends them to the ranks whose states hold them too.
void share_replicated(const Context& c, const DistributedState& state, snapshot_part::Decoded& d,
                      std::string& failure) {
  const auto all = all_gather_bytes(failure.empty() ? describe(d, state) : std::string(),
                                    CollectiveOptions().group(c.bytes));
  std::map<std::string, std::pair<int, std::string>> owner;  // name -> {rank, "numel dtype"}
  std::vector<std::vector<std::string>> needs(c.world);
  for (int q = 0; q < c.world; ++q) {
    std::istringstream in(all[q]);
    std::string kind, numel, dtype, name;
    while (in >> kind >> numel >> dtype && std::getline(in, name)) {
      name = name.substr(1);
      if (kind == "o") owner.emplace(name, std::make_pair(q, numel + " " + dtype));
      else needs[q].push_back(name);
    }
  }
  for (const auto& name : d.needs) {
    if (!failure.empty()) break;
    const auto& t = state.replicated.at(name);
    auto it = owner.find(name);
    if (it == owner.end())
      failure = "no rank's part of the snapshot holds " + name + ", which this rank's state holds";
    else if (it->second.second != std::to_string(t.numel()) + " " + std::to_string(static_cast<int>(t.scalar_type())))
      failure = name + " was another size or dtype when the snapshot was taken (rank " +
                std::to_string(it->second.first) + "'s part): restore needs the snapshot's layout";
  }
  agree<InvalidArgument>(c, failure);
  const dtrain::detail::InternalTraffic own;
  const P2POptions opts = part_options(c);
  std::vector<WorkPtr> works;
  for (int q = 0; q < c.world; ++q)
    for (const auto& name : needs[q])
      if (q != c.rank && owner.at(name).first == c.rank) works.push_back(isend(d.owned.at(name), c.global(q), opts));
  for (const auto& name : d.needs) {
    const auto& t = state.replicated.at(name);
    at::Tensor into = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
    works.push_back(irecv(into, c.global(owner.at(name).first), opts));
    d.fills.emplace_back(t, into);
  }
  for (auto& w : works) w->wait();
}

}  // namespace

Staged stage(const Context& c, int64_t step, const DistributedState& state) {
  DTRAIN_CHECK_ARG(step >= 0, c.what, ": the step must not be negative");
  for (const auto& hook : state.before_save) hook();
  // Each replicated entry in one rank's part only: save()'s plan (collective;
  // its InvalidArgument is the same on every rank).
  std::set<std::string> owned;
  for (const auto& [name, owner] : files::plan_save(c.group, state).replicated_owner)
    if (owner == c.rank) owned.insert(name);
  // A rank that fails goes on with the others to the agreement, which
  // fails them all: nobody waits for it in a collective it left.
  Staged staged;
  staged.step = step;
  try {
    staged.part = snapshot_part::encode(state, owned, step, c.rank, c.world);
  } catch (const Error& e) {
    staged.failure = e.what();
  }
  return staged;
}

SnapshotInfo transfer(const Context& c, Staged staged) {
  const int64_t step = staged.step;
  std::string failure = std::move(staged.failure), part = std::move(staged.part);
  uint64_t keeper = 0;
  try {
    keeper = c.listing().keeper;
  } catch (const Error& e) {
    if (failure.empty()) failure = e.what();
  }
  std::vector<uint64_t> keepers = all_gather_object<uint64_t>(keeper, CollectiveOptions().group(c.bytes));
  const int to = replica_target(keepers, c.rank);
  std::vector<int> from;
  for (int q = 0; q < c.world; ++q)
    if (replica_target(keepers, q) == c.rank) from.push_back(q);
  SnapshotInfo info{step, part.size(), to >= 0 ? part.size() : 0};
  auto keep = [&](int whose, std::string bytes) {
    if (!failure.empty()) return;
    try {
      c.ask(wire::Op::Put, step, whose, std::move(bytes));
    } catch (const Error& e) {
      failure = e.what();
    }
  };
  auto received = exchange(c, part, to, from);
  keep(c.rank, std::move(part));
  for (size_t i = 0; i < from.size(); ++i) keep(from[i], std::move(received[i]));
  agree<Error>(c, failure);
  // Agreed too: a keeper that refuses or cannot be reached makes every
  // rank throw, as snapshot.h says.
  std::string committed;
  try {
    if (commit_refused_on.load() == c.rank)
      throw Error(c.what + ": this host's keeper refused the commit (the test seam)");
    c.ask(wire::Op::Commit, step, c.rank);
  } catch (const Error& e) {
    committed = e.what();
  }
  agree<Error>(c, committed);
  return info;
}

}  // namespace snapshot_detail

namespace detail {
void refuse_snapshot_commit_on(int rank) { snapshot_detail::commit_refused_on = rank; }
}  // namespace detail

using namespace snapshot_detail;

SnapshotInfo snapshot(int64_t step, const DistributedState& state, const SnapshotOptions& options) {
  const Context c = context_of(options, "checkpoint::snapshot of step " + std::to_string(step));
  wait_for_async_snapshot(c.group, c.what);
  return transfer(c, stage(c, step, state));
}

std::optional<int64_t> restore_snapshot(DistributedState& state, int64_t newer_than, const SnapshotOptions& options) {
  const Context c = context_of(options, "checkpoint::restore_snapshot");
  wait_for_async_snapshot(c.group, c.what);
  std::string failure, listing;
  try {
    listing = wire::encode_listing(c.listing());
  } catch (const Error& e) {
    failure = e.what();
    listing = wire::encode_listing({});
  }
  const auto listed = all_gather_bytes(listing, CollectiveOptions().group(c.bytes));
  agree<Error>(c, failure);
  std::vector<wire::Listing> listings;
  for (size_t q = 0; q < listed.size(); ++q)
    listings.push_back(wire::decode_listing(listed[q], c.what + ": rank " + std::to_string(q) + "'s keeper"));
  const auto [step, holders] = newest_complete(listings, newer_than, c.world);
  if (step < 0) return std::nullopt;
  std::string mine = fetch_part(c, listings, step, holders, failure);
  agree<Error>(c, failure);
  // Checked everywhere before any rank's state changes.
  snapshot_part::Decoded d;
  try {
    d = snapshot_part::check(mine, state, step, c.rank, c.world,
                             c.what + ": rank " + std::to_string(c.rank) + "'s part of the snapshot of step " +
                                 std::to_string(step));
  } catch (const InvalidArgument& e) {
    failure = e.what();
  }
  share_replicated(c, state, d, failure);
  {
    at::NoGradGuard no_grad;
    for (auto& [to, from] : d.fills) to.detach().copy_(from);
  }
  state.metadata = std::move(d.metadata);
  for (const auto& hook : state.after_load) hook();
  return step;
}

}  // namespace dtrain::checkpoint
