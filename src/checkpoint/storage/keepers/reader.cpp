// The keepers storage's reader (restore_snapshot): the newest snapshot the
// keepers hold completely, each rank's part from its own host's keeper or,
// where that host lost it, from another's.

#include <algorithm>
#include <map>
#include <optional>
#include <sstream>

#include "checkpoint/storage/keepers/keepers.h"
#include "checkpoint/storage/part.h"
#include "common/enforce.h"
#include "core/internal_tags.h"
#include "dtrain/objects.h"

namespace dtrain::checkpoint::storage::keepers {
namespace {

using Parts = std::vector<std::pair<uint32_t, uint64_t>>;

// The size of rank r's part of `step` among `parts` (of that step and
// world, else none).
std::optional<uint64_t> part_in(int64_t of, uint32_t of_world, const Parts& parts, int64_t step, int world, int r) {
  if (of != step || of_world != static_cast<uint32_t>(world)) return std::nullopt;
  for (const auto& p : parts)
    if (p.first == static_cast<uint32_t>(r)) return p.second;
  return std::nullopt;
}

// Whether listing `l` holds rank r's part of `step`, and its size: in its
// complete snapshot, or (unless `committed_only`) in the one being written
// (wire.h's Listing says why that counts once some keeper committed the
// step).
std::optional<uint64_t> held(const wire::Listing& l, int64_t step, int world, int r, bool committed_only = false) {
  if (auto size = part_in(l.step, l.world, l.parts, step, world, r)) return size;
  if (committed_only) return std::nullopt;
  return part_in(l.writing_step, l.writing_world, l.writing_parts, step, world, r);
}

// The newest snapshot after `newer_than` that some keeper committed and
// whose every part some keeper holds, and the holder of each part: a
// keeper that committed it before one that did not, and among those the
// rank itself, then the next ranks'. {-1, {}} when none. (A step no keeper
// committed may have failed its agreement: its parts are not trusted.)
std::pair<int64_t, std::vector<int>> newest_complete(const std::vector<wire::Listing>& listings, int64_t newer_than,
                                                     int world) {
  std::vector<int64_t> steps;
  for (const auto& l : listings)
    if (l.step > newer_than && l.world == static_cast<uint32_t>(world)) steps.push_back(l.step);
  std::sort(steps.rbegin(), steps.rend());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  for (int64_t step : steps) {
    std::vector<int> holders(world, -1);
    bool complete = true;
    for (int r = 0; r < world && complete; ++r) {
      for (bool committed_only : {true, false})
        for (int q = r; q < world + r && holders[r] < 0; ++q)
          if (held(listings[q % world], step, world, r, committed_only)) holders[r] = q % world;
      complete = holders[r] >= 0;
    }
    if (complete) return {step, holders};
  }
  return {-1, {}};
}

uint64_t part_size(const wire::Listing& l, int64_t step, int world, int r) { return held(l, step, world, r).value_or(0); }

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

}  // namespace

SnapshotReader::SnapshotReader(Keeper keeper, std::shared_ptr<ProcessGroup> group, int64_t newer_than)
    : keeper_(std::move(keeper)), group_(std::move(group)), newer_than_(newer_than) {}

namespace {

// This rank's part of `step`: each holder reads the parts it serves from
// its keeper and sends those of other ranks. A keeper that fails sets
// `failure`; the bytes are still sent (zeros), so that nobody waits.
std::string fetch_part(const Keeper& keeper, const std::shared_ptr<ProcessGroup>& group,
                       const std::vector<wire::Listing>& listings, int64_t step, const std::vector<int>& holders,
                       std::string& failure) {
  const dtrain::detail::InternalTraffic own;
  const P2POptions opts = part_options(group);
  const int rank = group->rank(), world = group->size();
  std::vector<std::string> served;
  served.reserve(world);  // as_bytes views them while they are sent
  std::string mine;
  std::vector<WorkPtr> works;
  for (int r = 0; r < world; ++r) {
    if (holders[r] != rank) continue;
    const uint64_t size = part_size(listings[rank], step, world, r);
    std::string bytes;
    try {
      bytes = keeper.ask(wire::Op::Get, step, r, {}, size);
      if (bytes.size() != size)
        throw Error("the keeper gave " + std::to_string(bytes.size()) + " bytes of rank " + std::to_string(r) +
                    "'s part, not the " + std::to_string(size) + " listed");
    } catch (const Error& e) {
      if (failure.empty()) failure = e.what();
      bytes.assign(size, '\0');
    }
    if (r == rank) {
      mine = std::move(bytes);
      continue;
    }
    served.push_back(std::move(bytes));
    if (size > 0) works.push_back(isend(as_bytes(served.back()), global_rank(*group, r), opts));
  }
  if (holders[rank] != rank) {
    mine.resize(part_size(listings[holders[rank]], step, world, rank));
    if (!mine.empty()) works.push_back(irecv(as_bytes(mine), global_rank(*group, holders[rank]), opts));
  }
  for (auto& w : works) w->wait();
  return mine;
}

// Every rank's replicated entries from the one part that holds each: after
// the agreement (which `failure`, this rank's problem so far, joins), each
// holder sends them to the ranks whose states hold them too.
void share_replicated(const std::shared_ptr<ProcessGroup>& group, const std::string& what,
                      const DistributedState& state, snapshot_part::Decoded& d, std::string& failure) {
  const int rank = group->rank(), world = group->size();
  const auto all = all_gather_bytes(failure.empty() ? describe(d, state) : std::string(),
                                    CollectiveOptions().group(group));
  std::map<std::string, std::pair<int, std::string>> owner;  // name -> {rank, "numel dtype"}
  std::vector<std::vector<std::string>> needs(world);
  for (int q = 0; q < world; ++q) {
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
  agree<InvalidArgument>(group, what, failure);
  const dtrain::detail::InternalTraffic own;
  const P2POptions opts = part_options(group);
  std::vector<WorkPtr> works;
  for (int q = 0; q < world; ++q)
    for (const auto& name : needs[q])
      if (q != rank && owner.at(name).first == rank) works.push_back(isend(d.owned.at(name), global_rank(*group, q), opts));
  for (const auto& name : d.needs) {
    const auto& t = state.replicated.at(name);
    at::Tensor into = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
    works.push_back(irecv(into, global_rank(*group, owner.at(name).first), opts));
    d.fills.emplace_back(t, into);
  }
  for (auto& w : works) w->wait();
}

}  // namespace

std::optional<Loaded> SnapshotReader::read(const DistributedState& state) {
  const std::string& what = keeper_.what;
  const int rank = group_->rank(), world = group_->size();
  std::string failure, listing;
  try {
    listing = wire::encode_listing(keeper_.listing());
  } catch (const Error& e) {
    failure = e.what();
    listing = wire::encode_listing({});
  }
  const auto listed = all_gather_bytes(listing, CollectiveOptions().group(group_));
  agree<Error>(group_, what, failure);
  std::vector<wire::Listing> listings;
  for (size_t q = 0; q < listed.size(); ++q)
    listings.push_back(wire::decode_listing(listed[q], what + ": rank " + std::to_string(q) + "'s keeper"));
  const auto [step, holders] = newest_complete(listings, newer_than_, world);
  if (step < 0) return std::nullopt;
  std::string mine = fetch_part(keeper_, group_, listings, step, holders, failure);
  agree<Error>(group_, what, failure);
  // Checked everywhere before any rank's state changes.
  snapshot_part::Decoded d;
  try {
    d = snapshot_part::check(mine, state, step, rank, world,
                             what + ": rank " + std::to_string(rank) + "'s part of the snapshot of step " +
                                 std::to_string(step));
  } catch (const InvalidArgument& e) {
    failure = e.what();
  }
  share_replicated(group_, what, state, d, failure);
  step_ = step;
  return Loaded{std::move(d.fills), std::move(d.metadata)};
}

}  // namespace dtrain::checkpoint::storage::keepers
