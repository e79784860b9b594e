// The keepers storage's writer: a rank's part kept in its host's keeper
// and in another host's, then, once every part is kept, committed.

#include <algorithm>
#include <atomic>

#include "checkpoint/storage/keepers/keepers.h"
#include "checkpoint/storage/part.h"
#include "checkpoint/storage/keepers/seam.h"
#include "common/enforce.h"
#include "core/internal_tags.h"
#include "dtrain/objects.h"

namespace dtrain::checkpoint::storage::keepers {
namespace {

std::atomic<int> commit_refused_on{-1};  // the test seam (seam.h)

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

// Sends this rank's part to `to` and receives the parts of `from`, all
// posted at once; sizes first.
std::vector<std::string> exchange(const std::shared_ptr<ProcessGroup>& group, const std::string& what,
                                  std::string& part, int to, const std::vector<int>& from) {
  const dtrain::detail::InternalTraffic own;
  const P2POptions opts = part_options(group);
  at::Tensor size_out = at::full({1}, static_cast<int64_t>(part.size()), at::kLong);
  std::vector<at::Tensor> sizes_in;
  std::vector<WorkPtr> works;
  if (to >= 0) works.push_back(isend(size_out, global_rank(*group, to), opts));
  for (int f : from) {
    sizes_in.push_back(at::zeros({1}, at::kLong));
    works.push_back(irecv(sizes_in.back(), global_rank(*group, f), opts));
  }
  for (auto& w : works) w->wait();
  works.clear();
  std::vector<std::string> parts(from.size());
  if (to >= 0 && !part.empty()) works.push_back(isend(as_bytes(part), global_rank(*group, to), opts));
  for (size_t i = 0; i < from.size(); ++i) {
    const int64_t n = sizes_in[i].item<int64_t>();
    DTRAIN_CHECK_ARG(n >= 0 && n <= (int64_t{1} << 46), what, ": rank ", from[i], " announced a part of ", n, " bytes");
    parts[i].resize(static_cast<size_t>(n));
    if (n > 0) works.push_back(irecv(as_bytes(parts[i]), global_rank(*group, from[i]), opts));
  }
  for (auto& w : works) w->wait();
  return parts;
}

class KeepersWriter final : public Writer {
 public:
  KeepersWriter(int64_t step, Keeper keeper) : step_(step), keeper_(std::move(keeper)) {}

  const std::string& context() const override { return keeper_.what; }
  const char* lane() const override { return kLane; }
  bool needs_cpu_group() const override { return true; }

  // Each replicated entry in one rank's part only (the plan's owner), and
  // every piece: a rank restores its own part.
  Part select(const DistributedState& state, const SavePlan& plan, int rank) const override {
    Part part = Writer::select(state, plan, rank);
    part.sharded = state.sharded;
    return part;
  }

  // A rank that failed goes on with the others to the agreement, which
  // fails them all: nobody waits for it in a collective it left.
  Written write(const Part& part, const SavePlan&, const std::shared_ptr<ProcessGroup>& group,
                const std::string& prior) override {
    const int rank = group->rank(), world = group->size();
    std::string failure = prior, bytes;
    if (failure.empty()) {
      try {
        bytes = snapshot_part::encode(part, step_, rank, world);
      } catch (const Error& e) {
        failure = e.what();
      }
    }
    uint64_t keeper = 0;
    try {
      keeper = keeper_.listing().keeper;
    } catch (const Error& e) {
      if (failure.empty()) failure = e.what();
    }
    const auto keepers = all_gather_object<uint64_t>(keeper, CollectiveOptions().group(group));
    const int to = replica_target(keepers, rank);
    std::vector<int> from;
    for (int q = 0; q < world; ++q)
      if (replica_target(keepers, q) == rank) from.push_back(q);
    Written written{bytes.size(), to >= 0 ? bytes.size() : 0};
    auto keep = [&](int whose, std::string part_bytes) {
      if (!failure.empty()) return;
      try {
        keeper_.ask(wire::Op::Put, step_, whose, std::move(part_bytes));
      } catch (const Error& e) {
        failure = e.what();
      }
    };
    auto received = exchange(group, keeper_.what, bytes, to, from);
    keep(rank, std::move(bytes));
    for (size_t i = 0; i < from.size(); ++i) keep(from[i], std::move(received[i]));
    agree<Error>(group, keeper_.what, failure);
    // Agreed too: a keeper that refuses or cannot be reached makes every
    // rank throw, as snapshot.h says.
    std::string committed;
    try {
      if (commit_refused_on.load() == rank)
        throw Error(keeper_.what + ": this host's keeper refused the commit (the test seam)");
      keeper_.ask(wire::Op::Commit, step_, rank);
    } catch (const Error& e) {
      committed = e.what();
    }
    agree<Error>(group, keeper_.what, committed);
    return written;
  }

 private:
  int64_t step_;
  Keeper keeper_;
};

}  // namespace

std::unique_ptr<Writer> writer(int64_t step, Keeper keeper) {
  return std::make_unique<KeepersWriter>(step, std::move(keeper));
}

}  // namespace dtrain::checkpoint::storage::keepers

namespace dtrain::checkpoint::detail {
void refuse_snapshot_commit_on(int rank) { storage::keepers::commit_refused_on = rank; }
}  // namespace dtrain::checkpoint::detail
