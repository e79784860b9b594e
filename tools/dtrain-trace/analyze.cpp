#include "analyze.h"

#include <algorithm>
#include <optional>
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

// Where a rank without a dump failed, as its error file says: dtrain's
// errors start "<op> #<seq> on group '<name>'".
struct FailedAt {
  std::string op, group, message;
  uint64_t seq = 0;
};

std::string first_line(const std::string& text) {
  std::string line = text.substr(0, text.find('\n'));
  return line.size() > 300 ? line.substr(0, 300) + "..." : line;
}

std::optional<FailedAt> failed_at(const std::string& message) {
  const std::string marker = " on group '";
  const auto on = message.find(marker);
  if (on == std::string::npos) return std::nullopt;
  const auto hash = message.rfind(" #", on);
  const auto name_end = message.find('\'', on + marker.size());
  if (hash == std::string::npos || hash + 2 >= on || name_end == std::string::npos) return std::nullopt;
  const std::string digits = message.substr(hash + 2, on - hash - 2);
  if (digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  auto op_begin = message.rfind(' ', hash - 1);
  op_begin = op_begin == std::string::npos ? 0 : op_begin + 1;
  FailedAt f;
  f.op = message.substr(op_begin, hash - op_begin);
  f.seq = std::stoull(digits);
  f.group = message.substr(on + marker.size(), name_end - on - marker.size());
  f.message = first_line(message);
  return f;
}

std::string at_text(const FailedAt& f) {
  return "#" + std::to_string(f.seq) + " " + f.op + " (failed: " + f.message + ")";
}

// One group as every rank that dumped saw it: its collectives by sequence
// number, per global rank; and where ranks that left only an error file
// failed in it.
struct GroupView {
  std::string name;
  std::vector<int> members;                             // global ranks
  std::map<int, std::map<uint64_t, const Entry*>> ops;  // global rank -> seq -> entry
  std::map<int, FailedAt> failed;                       // global rank -> its error's op
};

std::vector<GroupView> group_views(const Evidence& ev) {
  std::map<std::string, GroupView> views;
  for (const auto& [rank, dump] : ev.dumps) {
    for (const auto& g : dump.groups) {
      auto& v = views[g.name];
      v.name = g.name;
      if (v.members.empty()) v.members = g.global_ranks;
      auto& mine = v.ops[rank];
      for (const auto& e : g.entries)
        if (e.collective()) mine[e.seq] = &e;
    }
  }
  for (const auto& [rank, note] : ev.errors) {
    const auto f = failed_at(note.message);
    if (ev.dumps.count(rank) || !f || !views.count(f->group)) continue;
    auto& v = views[f->group];
    if (std::find(v.members.begin(), v.members.end(), rank) != v.members.end()) v.failed[rank] = *f;
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
  std::string front;  // the leaders' latest collective
};

// Ranks with a dump, or with an error file that says where they failed,
// are placed by their latest collective; the others are absent.
Progress progress(const GroupView& v, const std::map<int, Dump>& dumps) {
  Progress p;
  int64_t top = -1;
  for (const auto& [rank, ops] : v.ops)
    if (!ops.empty()) top = std::max<int64_t>(top, static_cast<int64_t>(ops.rbegin()->first));
  for (const auto& [rank, f] : v.failed) top = std::max<int64_t>(top, static_cast<int64_t>(f.seq));
  std::string error_front;
  for (int r : v.members) {
    const auto failed = v.failed.find(r);
    if (!dumps.count(r) && failed == v.failed.end()) {
      p.absent.push_back(r);
      continue;
    }
    auto it = v.ops.find(r);
    const bool empty = it == v.ops.end() || it->second.empty();
    int64_t last = empty ? -1 : static_cast<int64_t>(it->second.rbegin()->first);
    if (failed != v.failed.end()) last = static_cast<int64_t>(failed->second.seq);
    if (last != top) {
      p.behind.push_back(r);
      continue;
    }
    p.leaders.push_back(r);
    if (p.front.empty() && !empty) p.front = at_text(*it->second.rbegin()->second);
    if (error_front.empty() && failed != v.failed.end()) error_front = at_text(failed->second);
  }
  if (p.front.empty()) p.front = error_front.empty() ? "no collective yet" : error_front;
  return p;
}

std::string last_of(const GroupView& v, int rank) {
  if (auto f = v.failed.find(rank); f != v.failed.end()) return at_text(f->second);
  auto it = v.ops.find(rank);
  if (it == v.ops.end() || it->second.empty()) return "none yet";
  return at_text(*it->second.rbegin()->second);
}

// In each group, each rank's first point-to-point operation that failed or
// never finished, with its label: where a pipeline stage waits.
void note_p2p(const Evidence& ev, Report& report, std::string& stuck) {
  for (const auto& [rank, dump] : ev.dumps)
    for (const auto& g : dump.groups)
      for (const auto& e : g.entries) {
        if (e.collective() || e.state == "completed") continue;
        std::ostringstream line;
        line << "rank " << rank << " in group '" << g.name << "': " << e.op << " #" << e.seq
             << (e.op == "send" ? " to" : " from") << " group rank " << e.root;
        if (!e.label.empty()) line << " [" << e.label << "]";
        line << " " << (e.state == "failed" ? "failed: " + first_line(e.error)
                                            : "did not complete (" + e.state + ")");
        report.findings.push_back(line.str());
        if (stuck.empty()) stuck = line.str();
        break;
      }
}

// Where each piece of evidence came from, first in the findings.
void note_sources(const Evidence& ev, int world, Report& report) {
  std::vector<int> no_dump;
  for (int r = 0; r < world; ++r)
    if (!ev.dumps.count(r) && !ev.errors.count(r)) no_dump.push_back(r);
  for (const auto& [rank, d] : ev.dumps) {
    std::string line = "rank " + std::to_string(rank) + " (" + d.host + ", pid " +
                       std::to_string(d.pid) + ") dumped on " + d.reason;
    if (d.incomplete)
      line += " (incomplete: " + d.path + " was cut short; what it holds whole is used)";
    report.findings.push_back(line);
  }
  for (const auto& [rank, note] : ev.errors)
    if (!ev.dumps.count(rank))
      report.findings.push_back("rank " + std::to_string(rank) + " left no dump; its error file (" +
                                note.path + ") says: " + first_line(note.message));
  for (const auto& problem : ev.unusable) report.findings.push_back(problem);
  if (!no_dump.empty())
    report.findings.push_back(ranks_text(no_dump) +
                              ": no dump (exited, killed, stopped, or hung outside dtrain)");
}

}  // namespace

Report analyze(const std::map<int, Dump>& dumps) {
  Evidence ev;
  ev.dumps = dumps;
  return analyze(ev);
}

Report analyze(const Evidence& ev) {
  const auto& dumps = ev.dumps;
  Report report;
  int world = -1;
  for (const auto& [rank, d] : dumps) world = std::max({world, d.world_size, rank + 1});
  note_sources(ev, world, report);
  std::string mismatch, missing, behind, failure;
  for (const auto& v : group_views(ev)) {
    std::vector<int> culprits;
    const auto m = first_mismatch(v, culprits);
    if (!m.empty()) {
      report.findings.push_back(m);
      if (mismatch.empty()) mismatch = ranks_text(culprits) + " called a different collective: " + m;
    }
    const auto p = progress(v, dumps);
    const std::string& front = p.front;
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
    for (const auto& [rank, f] : v.failed) {
      auto line = "rank " + std::to_string(rank) + " failed in group '" + v.name + "' at " +
                  at_text(f) + " (from its error file)";
      report.findings.push_back(line);
      if (failure.empty()) failure = line;
    }
  }
  std::string stuck;
  note_p2p(ev, report, stuck);
  if (!mismatch.empty()) report.verdict = "verdict: " + mismatch;
  else if (!missing.empty()) report.verdict = "verdict: " + missing;
  else if (!behind.empty()) report.verdict = "verdict: " + behind;
  else if (!failure.empty()) report.verdict = "verdict: every rank reached the same collective; " + failure;
  else if (!stuck.empty()) report.verdict = "verdict: the collectives agree; " + stuck;
  else report.verdict = "verdict: the ranks agree and none is behind";
  return report;
}

}  // namespace dtrain::trace
