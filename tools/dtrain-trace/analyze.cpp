#include "analyze.h"

#include <algorithm>
#include <set>
#include <sstream>

namespace dtrain::trace {
namespace {

std::string ranks_text(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

std::string at_text(const Entry& e) {
  std::ostringstream out;
  out << "#" << e.seq << " " << e.signature() << " (" << e.state;
  if (!e.error.empty()) out << ": " << e.error;
  out << ")";
  return out.str();
}

// One group as every rank that dumped saw it: its collectives by sequence
// number, per global rank.
struct GroupView {
  std::string name;
  std::vector<int> members;                             // global ranks
  std::map<int, std::map<uint64_t, const Entry*>> ops;  // global rank -> seq -> entry
};

std::vector<GroupView> group_views(const std::map<int, Dump>& dumps) {
  std::map<std::string, GroupView> views;
  for (const auto& [rank, dump] : dumps) {
    for (const auto& g : dump.groups) {
      auto& v = views[g.name];
      v.name = g.name;
      if (v.members.empty()) v.members = g.global_ranks;
      auto& mine = v.ops[rank];
      for (const auto& e : g.entries)
        if (e.collective()) mine[e.seq] = &e;
    }
  }
  std::vector<GroupView> out;
  if (views.count("default")) out.push_back(views["default"]);
  for (auto& [name, v] : views)
    if (name != "default") out.push_back(v);
  return out;
}

// The first sequence number at which the ranks' collectives differ: "" when
// they never do. `culprits` gets the ranks in the minority.
std::string first_mismatch(const GroupView& v, std::vector<int>& culprits) {
  std::set<uint64_t> seqs;
  for (const auto& [rank, ops] : v.ops)
    for (const auto& [seq, e] : ops) seqs.insert(seq);
  for (uint64_t seq : seqs) {
    std::map<std::string, std::vector<int>> by_signature;
    for (const auto& [rank, ops] : v.ops) {
      auto it = ops.find(seq);
      if (it != ops.end()) by_signature[it->second->signature()].push_back(rank);
    }
    if (by_signature.size() < 2) continue;
    auto majority = by_signature.begin();
    for (auto it = by_signature.begin(); it != by_signature.end(); ++it)
      if (it->second.size() > majority->second.size() ||
          (it->second.size() == majority->second.size() && it->second[0] < majority->second[0]))
        majority = it;
    std::ostringstream out;
    bool first = true;
    for (const auto& [sig, ranks] : by_signature) {
      if (sig == majority->first) continue;
      culprits.insert(culprits.end(), ranks.begin(), ranks.end());
      out << (first ? "" : "; ") << ranks_text(ranks) << " called " << sig;
      first = false;
    }
    out << " at collective #" << seq << " of group '" << v.name << "' where "
        << ranks_text(majority->second) << " called " << majority->first;
    return out.str();
  }
  return "";
}

struct Progress {
  std::vector<int> leaders, behind, absent;
  const Entry* front = nullptr;  // the leaders' latest collective
};

Progress progress(const GroupView& v, const std::map<int, Dump>& dumps) {
  Progress p;
  int64_t top = -1;
  for (const auto& [rank, ops] : v.ops)
    if (!ops.empty()) top = std::max<int64_t>(top, static_cast<int64_t>(ops.rbegin()->first));
  for (int r : v.members) {
    if (!dumps.count(r)) {
      p.absent.push_back(r);
      continue;
    }
    auto it = v.ops.find(r);
    const bool empty = it == v.ops.end() || it->second.empty();
    const int64_t last = empty ? -1 : static_cast<int64_t>(it->second.rbegin()->first);
    if (last == top) {
      p.leaders.push_back(r);
      if (!p.front && !empty) p.front = it->second.rbegin()->second;
    } else {
      p.behind.push_back(r);
    }
  }
  return p;
}

std::string last_of(const GroupView& v, int rank) {
  auto it = v.ops.find(rank);
  if (it == v.ops.end() || it->second.empty()) return "none yet";
  return at_text(*it->second.rbegin()->second);
}

}  // namespace

Report analyze(const std::map<int, Dump>& dumps) {
  Report report;
  int world = -1;
  for (const auto& [rank, d] : dumps) world = std::max({world, d.world_size, rank + 1});
  std::vector<int> no_dump;
  for (int r = 0; r < world; ++r)
    if (!dumps.count(r)) no_dump.push_back(r);
  for (const auto& [rank, d] : dumps)
    report.findings.push_back("rank " + std::to_string(rank) + " (" + d.host + ", pid " +
                              std::to_string(d.pid) + ") dumped on " + d.reason);
  if (!no_dump.empty())
    report.findings.push_back(ranks_text(no_dump) +
                              ": no dump (exited, killed, stopped, or hung outside dtrain)");
  std::string mismatch, missing, behind, failure;
  for (const auto& v : group_views(dumps)) {
    std::vector<int> culprits;
    const auto m = first_mismatch(v, culprits);
    if (!m.empty()) {
      report.findings.push_back(m);
      if (mismatch.empty()) mismatch = ranks_text(culprits) + " called a different collective: " + m;
    }
    const auto p = progress(v, dumps);
    const std::string front = p.front ? at_text(*p.front) : "no collective yet";
    if (!p.absent.empty()) {
      auto line = ranks_text(p.absent) + " of group '" + v.name + "' left no dump while " +
                  ranks_text(p.leaders) + " reached " + front;
      report.findings.push_back(line);
      if (missing.empty())
        missing = ranks_text(p.absent) + " never arrived (no dump: exited, killed or stopped): " +
                  line;
    }
    for (int r : p.behind) {
      auto line = "rank " + std::to_string(r) + " is behind in group '" + v.name +
                  "': its last collective is " + last_of(v, r) + ", while " +
                  ranks_text(p.leaders) + " reached " + front;
      report.findings.push_back(line);
      if (behind.empty()) behind = line;
    }
    for (const auto& [rank, ops] : v.ops) {
      for (const auto& [seq, e] : ops) {
        if (e->state != "failed") continue;
        auto line = "rank " + std::to_string(rank) + " failed in group '" + v.name + "' at " +
                    at_text(*e);
        report.findings.push_back(line);
        if (failure.empty()) failure = line;
        break;
      }
    }
  }
  if (!mismatch.empty()) report.verdict = "verdict: " + mismatch;
  else if (!missing.empty()) report.verdict = "verdict: " + missing;
  else if (!behind.empty()) report.verdict = "verdict: " + behind;
  else if (!failure.empty()) report.verdict = "verdict: every rank reached the same collective; " + failure;
  else report.verdict = "verdict: the ranks agree and none is behind";
  return report;
}

}  // namespace dtrain::trace
