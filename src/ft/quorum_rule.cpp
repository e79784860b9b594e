#include "ft/quorum_rule.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "common/enforce.h"

namespace dtrain::ft {
namespace {

// The lineage the members at `max_step` go on with (see view_of): a
// known one over the unknown (""), then the most held, then the first held.
std::string winning_lineage(const std::vector<protocol::Member>& members, int64_t max_step) {
  std::map<std::string, std::pair<int, size_t>> held;  // lineage -> (members, first member)
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i].step == max_step) held.emplace(members[i].lineage, std::make_pair(0, i)).first->second.first++;
  auto rank = [](const auto& entry) {  // larger is better
    return std::make_tuple(!entry.first.empty(), entry.second.first, -static_cast<int64_t>(entry.second.second));
  };
  return std::max_element(held.begin(), held.end(),
                          [&](const auto& x, const auto& y) { return rank(x) < rank(y); })
      ->first;
}

}  // namespace

std::optional<std::set<std::string>> decide_quorum(const QuorumInputs& in) {
  if (static_cast<int>(in.asking.size()) < std::max(in.min_replicas, 1)) return std::nullopt;
  auto asks = [&](const std::string& r) { return in.asking.count(r) > 0; };
  const bool previous_all_ask =
      !in.previous.empty() && std::all_of(in.previous.begin(), in.previous.end(), asks);
  const bool live_all_ask = std::all_of(in.live.begin(), in.live.end(), asks);
  if (previous_all_ask || live_all_ask || in.now - in.first_asked >= in.join_timeout) return in.asking;
  return std::nullopt;
}

QuorumView view_of(const protocol::Answer& answer, const std::string& me, bool init_sync,
                   bool async_quorum, int max_participants) {
  const auto& members = answer.members;
  DTRAIN_CHECK_ARG(!members.empty(), "quorum ", answer.quorum_id, " has no members");
  QuorumView v;
  v.quorum_id = answer.quorum_id;
  v.replica_world = static_cast<int>(members.size());
  v.replica_rank = -1;
  for (int i = 0; i < v.replica_world; ++i) {
    if (members[i].replica == me) v.replica_rank = i;
    v.max_step = std::max(v.max_step, members[i].step);
  }
  DTRAIN_CHECK_ARG(v.replica_rank >= 0, "quorum ", answer.quorum_id, " does not hold replica '", me, "'");
  // With init_sync at step 0 every member takes the first's state, and
  // with it the first's history, whatever lineages the others hold.
  const bool from_first = init_sync && v.max_step == 0;
  v.lineage = from_first ? members[0].lineage : winning_lineage(members, v.max_step);
  std::vector<int> up, behind;
  for (int i = 0; i < v.replica_world; ++i) {
    const bool same_history = members[i].lineage == v.lineage;
    (members[i].step == v.max_step && same_history && !(from_first && i > 0) ? up : behind).push_back(i);
  }
  DTRAIN_ENFORCE(!up.empty());  // member 0 at step 0, or one holding the winning lineage
  for (size_t j = 0; j < behind.size(); ++j) {
    const int source = up[j % up.size()];
    if (behind[j] == v.replica_rank) v.heal_source = source;
    if (source == v.replica_rank) v.heal_targets.push_back(behind[j]);
  }
  std::vector<int> candidates = up;
  if (!async_quorum) {
    candidates.resize(v.replica_world);
    for (int i = 0; i < v.replica_world; ++i) candidates[i] = i;
  }
  if (max_participants > 0 && static_cast<int>(candidates.size()) > max_participants)
    candidates.resize(max_participants);
  v.participants = static_cast<int>(candidates.size());
  const auto mine = std::find(candidates.begin(), candidates.end(), v.replica_rank);
  v.participant = mine == candidates.end() ? -1 : static_cast<int>(mine - candidates.begin());
  return v;
}

}  // namespace dtrain::ft
