#pragma once

// When the lighthouse forms a quorum, and what a quorum means to each of
// its members: pure functions of what was seen, torch-free (unit tested).

#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ft/protocol.h"

namespace dtrain::ft {

using Clock = std::chrono::steady_clock;

struct QuorumInputs {
  std::set<std::string> asking;     // live replicas with a request pending
  std::set<std::string> live;       // replicas whose heartbeats are recent
  std::set<std::string> previous;   // the last quorum's members
  Clock::time_point first_asked;    // when the oldest pending request came
  Clock::time_point now;
  int min_replicas = 1;
  std::chrono::milliseconds join_timeout{0};
};

// The members of the quorum to form now, or nullopt to wait: at least
// min_replicas asking, and every previous member asking (the fast path),
// or every live replica asking, or join_timeout passed since the first.
std::optional<std::set<std::string>> decide_quorum(const QuorumInputs& in);

// What a quorum means to the member `me`.
struct QuorumView {
  std::string quorum_id;
  int replica_rank = 0;   // me among the members, in id order
  int replica_world = 1;  // the members
  int64_t max_step = 0;
  // The history the quorum goes on from: the lineage of the up-to-date
  // members (a member that heals takes it with its state).
  std::string lineage;
  // Members whose gradients count this step: those at max_step (a member
  // that heals asynchronously contributes zeros), or with a synchronous
  // quorum every member (they heal before the forward); with a fixed
  // number of participants, the first that many of those (in id order),
  // the others spares.
  int participants = 1;
  int participant = -1;  // me among them; -1: my gradients do not count (healing, or a spare)
  int heal_source = -1;           // the member I take my state from; -1: none
  std::vector<int> heal_targets;  // the members I send mine to
  bool healing() const { return heal_source >= 0; }
};

// Members behind max_step take the state of one at max_step (the j-th
// behind from the (j mod up-to-date)-th up to date). Members at max_step
// whose histories forked (a replica declared dead by mistake went on
// alone) are told apart by their lineage: the one most of them hold wins
// (a tie: the first member's, in id order; a known lineage over an
// unknown one), and the others heal as if behind. With init_sync, at
// step 0 every member but the first takes the first's state (and its
// lineage), so that replicas started from different values agree. `max_participants` > 0:
// at most that many participants (fixed with spares); 0: all.
QuorumView view_of(const protocol::Answer& answer, const std::string& me, bool init_sync,
                   bool async_quorum, int max_participants = 0);

}  // namespace dtrain::ft
