#pragma once

// What replicas and the lighthouse say to each other through the
// lighthouse's store (dtrain/ft/lighthouse.h). Torch-free; every parser
// takes its input as hostile (a value any holder of the job token could
// have written) and throws InvalidArgument naming what is wrong.
//
// Keys:
//   ft/lighthouse        the lighthouse's incarnation (set when it starts)
//   ft/requests          counter: a request takes the next number n
//   ft/request/<n>       a Request (the lighthouse reads and deletes it)
//   ft/answer/<n>        its Answer (the replica reads and deletes it)
//   ft/heartbeat/<id>    counter a live replica adds to
//   ft/registrations     counter: a replica's first heartbeat takes the next
//   ft/registration/<n>  its id (the lighthouse learns of it before it asks)
//   ft/group/<quorum>/<place>  where the place's cross-replica group
//                        rendezvous (deleted once the group is built)
//   ft/dead/<quorum>     the lighthouse's verdict: members of that quorum
//                        whose heartbeats stopped (deleted at the next quorum)

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::ft::protocol {

inline constexpr char kIncarnationKey[] = "ft/lighthouse";
inline constexpr char kRequestsKey[] = "ft/requests";
inline constexpr char kRegistrationsKey[] = "ft/registrations";
std::string request_key(int64_t n);
std::string registration_key(int64_t n);
std::string answer_key(int64_t n);
std::string heartbeat_key(const std::string& replica);
// Set by a replica's heartbeat connection as an ephemeral key (the store
// deletes it when that connection closes: the replica's process is gone).
std::string present_key(const std::string& replica);
std::string dead_key(const std::string& quorum_id);

// Replica ids: 1 to 64 of [A-Za-z0-9._-]; InvalidArgument otherwise.
void check_replica_id(const std::string& id, const std::string& what);

struct Request {
  std::string replica;
  int64_t step = 0;     // steps this replica has committed
  int world = 1;        // its number of ranks
  std::string layout;   // its state's fingerprint (hex, at most 64)
  // Its last step did not commit: its cross-replica groups may be broken,
  // so the quorum gets a new id (and new groups) even with the same members.
  bool rebuild = false;
  // Its Manager's start (hex, at most 32): a replica that restarted with the
  // same id and members gets a new quorum id, so no group of its previous
  // processes is taken for its own.
  std::string incarnation;
  // The quorum in which its state at `step` was committed (or that of the
  // member it healed from); empty: not known (never committed). Two
  // replicas at one step with different lineages hold different states: a
  // replica declared dead by mistake went on alone while the others formed
  // a quorum without it.
  std::string lineage;
};
std::string encode(const Request& request);
Request parse_request(const std::string& text);

struct Member {
  std::string replica;
  int64_t step = 0;
  std::string lineage;  // its Request's
};
struct Answer {
  std::string error;      // set: the request was refused
  std::string quorum_id;  // else the quorum
  std::vector<Member> members;  // in id order
};
std::string encode(const Answer& answer);
// At most kMaxMembers members, ids checked and in strictly increasing order.
Answer parse_answer(const std::string& text);

// A member the lighthouse found dead: its heartbeat connection closed
// (`closed`: its process ended), or no heartbeat for `silent_ms`.
struct Death {
  std::string replica;
  int64_t silent_ms = 0;
  bool closed = false;
};
std::string encode(const std::vector<Death>& deaths);
// At least one, at most kMaxMembers, ids checked.
std::vector<Death> parse_deaths(const std::string& text);
// "replica 'c' (no heartbeat for 1200 ms), replica 'd' (its connection to
// the lighthouse closed), ...".
std::string describe(const std::vector<Death>& deaths);

inline constexpr size_t kMaxMembers = 65536;
inline constexpr size_t kMaxText = 4u << 20;

}  // namespace dtrain::ft::protocol
