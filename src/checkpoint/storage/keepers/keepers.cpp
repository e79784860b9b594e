// What the keepers storage's writer and reader share: this host's keeper,
// the group's key in it, the agreement and the parts' messages.

#include "checkpoint/storage/keepers/keepers.h"

#include "common/enforce.h"
#include "common/env.h"
#include "core/internal_tags.h"
#include "dtrain/objects.h"
#include "dtrain/process_group.h"

namespace dtrain::checkpoint::storage::keepers {
namespace {

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

std::string Keeper::ask(wire::Op op, int64_t step, int part_rank, std::string payload, uint64_t max_answer) const {
  wire::Request r{op, step, static_cast<uint32_t>(part_rank), static_cast<uint32_t>(world), std::move(payload), key};
  return wire::call(socket, r, max_answer, wire::Clock::now() + kKeeperTimeout, what);
}

wire::Listing Keeper::listing() const {
  return wire::decode_listing(ask(wire::Op::List, 0, 0, {}, kListingBytes), what + ": this host's keeper");
}

std::string keeper_socket(const std::string& given, const std::string& what) {
  const std::string socket = given.empty() ? env::get(env::kSnapshotSocket).value_or("") : given;
  DTRAIN_CHECK_ARG(!socket.empty(), what, ": no snapshot keeper: run under dtrain-run, which sets ",
                   env::kSnapshotSocket.name, " (or give SnapshotOptions::keeper_socket)");
  return socket;
}

Keeper keeper_of(const std::string& socket, const ProcessGroup& group, const std::string& what) {
  Keeper k;
  k.what = what;
  k.socket = socket;
  k.key = group_key(group);
  k.world = group.size();
  return k;
}

template <typename E>
void agree(const std::shared_ptr<ProcessGroup>& group, const std::string& what, const std::string& mine) {
  const auto all = all_gather_bytes(mine, CollectiveOptions().group(group));
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) throw E(what + ": rank " + std::to_string(r) + ": " + all[r]);
}
template void agree<Error>(const std::shared_ptr<ProcessGroup>&, const std::string&, const std::string&);
template void agree<InvalidArgument>(const std::shared_ptr<ProcessGroup>&, const std::string&, const std::string&);

int global_rank(const ProcessGroup& group, int r) {
  const auto& g = group.global_ranks();
  return g.empty() ? r : g[r];
}

P2POptions part_options(const std::shared_ptr<ProcessGroup>& group) {
  return P2POptions().group(group).tag(group->max_tag() - dtrain::detail::kSnapshotTagFromTop);
}

at::Tensor as_bytes(std::string& s) {
  return at::from_blob(s.data(), {static_cast<int64_t>(s.size())}, at::TensorOptions().dtype(at::kByte));
}

}  // namespace dtrain::checkpoint::storage::keepers
