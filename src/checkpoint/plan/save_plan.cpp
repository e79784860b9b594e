// The save plan: every rank's entries gathered, checked against each other,
// and each replicated entry and each distinct piece of a sharded entry
// given to one of the ranks holding it, the one with the fewest bytes so
// far (in name order, so every rank computes the same plan).

#include "checkpoint/plan/save_plan.h"
#include "checkpoint/state/check.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <istream>
#include <sstream>
#include <vector>

#include "common/enforce.h"
#include "dtrain/objects.h"

namespace dtrain::checkpoint::files {
namespace {

struct Entry {
  int rank = 0;
  int64_t numel = 0, offset = 0, length = 0, bytes = 0;
  std::string dtype;
  std::vector<int64_t> shape, offsets, sizes;  // a box's (shape empty: a flat range)
  std::vector<int64_t> flat_shape;             // a flat range's whole, where it says it
};

struct Described {
  std::map<std::string, std::vector<Entry>> replicated, sharded;
};

// One line per entry, the name last: "r numel bytes dtype name",
// "s numel offset length k dims... bytes dtype name" (k: the flat range's
// whole shape's dimensions, 0 when it says none) or, for a box of n dimensions,
// "b numel n shape... offsets... sizes... bytes dtype name"; or, for a name that cannot be
// saved, "!" and the error, so that every rank throws it (not only this
// one, leaving the others in the all-gather).
std::string describe(const DistributedState& state) {
  std::ostringstream out;
  auto bad = [](const std::string& name) { return name.empty() || name.find('\n') != std::string::npos; };
  for (const auto& [name, t] : state.replicated) {
    if (bad(name)) return "!an entry's name is empty or holds a line break: '" + name + "'";
    out << "r " << t.numel() << ' ' << t.nbytes() << ' ' << t.scalar_type() << ' ' << name << '\n';
  }
  for (const auto& [name, s] : state.sharded) {
    if (bad(name)) return "!an entry's name is empty or holds a line break: '" + name + "'";
    if (s.is_box()) {
      out << "b " << s.numel << ' ' << s.shape.size();
      for (auto* v : {&s.shape, &s.offsets})
        for (int64_t x : *v) out << ' ' << x;
      for (int64_t x : s.local.sizes()) out << ' ' << x;
    } else {
      out << "s " << s.numel << ' ' << s.offset << ' ' << s.local.numel() << ' ' << s.flat_shape.size();
      for (int64_t x : s.flat_shape) out << ' ' << x;
    }
    out << ' ' << s.local.nbytes() << ' ' << s.local.scalar_type() << ' ' << name << '\n';
  }
  return out.str();
}

void read_box(std::istream& in, Entry& e);

// A flat range's offset, length and whole shape (at most 64 dimensions).
void read_flat(std::istream& in, Entry& e) {
  size_t n = 0;
  in >> e.offset >> e.length >> n;
  if (!in || n > 64) {
    in.setstate(std::ios::failbit);
    return;
  }
  e.flat_shape.resize(n);
  for (auto& x : e.flat_shape) in >> x;
}

Described parse(const std::vector<std::string>& texts) {
  Described all;
  for (int rank = 0; rank < static_cast<int>(texts.size()); ++rank) {
    DTRAIN_CHECK_ARG(texts[rank].empty() || texts[rank][0] != '!', "checkpoint::save: rank ", rank,
                     ": ", texts[rank].substr(texts[rank].empty() ? 0 : 1));
    std::istringstream lines(texts[rank]);
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream in(line);
      char kind = 0;
      Entry e;
      e.rank = rank;
      in >> kind >> e.numel;
      if (kind == 's') read_flat(in, e);
      if (kind == 'b') read_box(in, e);
      in >> e.bytes >> e.dtype;
      in.get();
      std::string name;
      std::getline(in, name);
      DTRAIN_CHECK_ARG(!in.fail() && (kind == 'r' || kind == 's' || kind == 'b') && !name.empty() && e.numel >= 0 &&
                           e.offset >= 0 && e.length >= 0,
                       "checkpoint::save: rank ", rank, " described an entry as '", line,
                       "', which is not an entry");
      (kind == 'r' ? all.replicated : all.sharded)[name].push_back(e);
    }
  }
  return all;
}

// A box's dimensions (at most 64), whole shape, offsets and sizes; its
// length is its element count.
void read_box(std::istream& in, Entry& e) {
  size_t n = 0;
  in >> n;
  if (!in || n == 0 || n > 64) {
    in.setstate(std::ios::failbit);
    return;
  }
  for (auto* v : {&e.shape, &e.offsets, &e.sizes}) {
    v->resize(n);
    for (auto& x : *v) in >> x;
  }
  e.length = 1;
  for (size_t d = 0; d < n; ++d) {
    if (e.offsets[d] < 0 || e.sizes[d] < 0 || e.offsets[d] + e.sizes[d] > e.shape[d]) in.setstate(std::ios::failbit);
    e.length *= e.sizes[d];
  }
}

std::string where(const Entry& e) {
  if (!e.shape.empty()) {
    std::string box;
    for (size_t d = 0; d < e.shape.size(); ++d)
      box += (d ? ", " : "") + std::to_string(e.offsets[d]) + ":" + std::to_string(e.offsets[d] + e.sizes[d]);
    return "[" + box + "] on rank " + std::to_string(e.rank);
  }
  return "[" + std::to_string(e.offset) + ", " + std::to_string(e.offset + e.length) + ") on rank " +
         std::to_string(e.rank);
}

bool boxes_overlap(const Entry& a, const Entry& b) {
  for (size_t d = 0; d < a.shape.size(); ++d)
    if (std::max(a.offsets[d], b.offsets[d]) >= std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]))
      return false;
  return true;
}

void check_disjoint(const std::string& name, const Entry& a, const Entry& b, bool disjoint) {
  DTRAIN_CHECK_ARG(disjoint, "checkpoint::save: the pieces of sharded '", name, "' overlap: ", where(a), " and ",
                   where(b), "; ranks must hold the same piece or disjoint ones");
}

// A sharded entry's distinct pieces, each with the ranks holding it: ranks
// hold the same flat range (or box) or disjoint ones, which together cover
// the whole.
std::vector<std::vector<Entry>> distinct_pieces(const std::string& name, std::vector<Entry> held) {
  const bool flat = held.front().shape.empty();
  const auto region = [flat](const Entry& e) {
    return flat ? std::make_pair(std::vector<int64_t>{e.offset}, std::vector<int64_t>{e.length})
                : std::make_pair(e.offsets, e.sizes);
  };
  std::sort(held.begin(), held.end(), [&](const Entry& a, const Entry& b) {
    return std::make_pair(region(a), a.rank) < std::make_pair(region(b), b.rank);
  });
  const int64_t numel = held.front().numel;
  std::vector<std::vector<Entry>> pieces;
  int64_t covered = 0;  // flat: where the next piece must start; boxes: elements held
  for (const auto& e : held) {
    if (e.length == 0) continue;
    if (!pieces.empty() && region(pieces.back()[0]) == region(e)) {
      pieces.back().push_back(e);
      continue;
    }
    if (flat) {  // in offset order, only the last piece can reach past e.offset
      check_disjoint(name, pieces.empty() ? e : pieces.back()[0], e, e.offset >= covered);
      DTRAIN_CHECK_ARG(e.offset == covered, "checkpoint::save: no rank holds elements [", covered, ", ",
                       e.offset, ") of sharded '", name, "'");
    } else {
      for (const auto& other : pieces) check_disjoint(name, other[0], e, !boxes_overlap(other[0], e));
    }
    pieces.push_back({e});
    covered += e.length;
  }
  if (flat)
    DTRAIN_CHECK_ARG(covered == numel, "checkpoint::save: no rank holds elements [", covered, ", ", numel,
                     ") of sharded '", name, "'");
  DTRAIN_CHECK_ARG(covered == numel, "checkpoint::save: the ranks hold ", covered, " of the ", numel,
                   " elements of sharded '", name, "'");
  return pieces;
}

// Every holder of an entry agrees on its size (and, replicated, its dtype).
void check_agree(const std::string& kind, const std::string& name, const std::vector<Entry>& held) {
  for (const auto& e : held) {
    const auto& first = held.front();
    DTRAIN_CHECK_ARG(e.numel == first.numel && e.dtype == first.dtype, "checkpoint::save: ", kind,
                     " '", name, "' is ", first.numel, " elements of ", first.dtype, " on rank ",
                     first.rank, " but ", e.numel, " of ", e.dtype,
                     " on rank ", e.rank, "; the ranks describe different states");
    DTRAIN_CHECK_ARG(e.shape == first.shape, "checkpoint::save: sharded '", name, "' is ",
                     first.shape.empty() ? "a flat range" : "a box", " on rank ", first.rank, " but ",
                     e.shape.empty() ? "a flat range" : "a box", " on rank ", e.rank,
                     " (or boxes of different wholes); the ranks describe different states");
    DTRAIN_CHECK_ARG(e.flat_shape == first.flat_shape, "checkpoint::save: sharded '", name,
                     "' is a flat range of shape ", state_checks::shape_text(first.flat_shape), " on rank ",
                     first.rank, " but of shape ", state_checks::shape_text(e.flat_shape), " on rank ", e.rank,
                     "; the ranks describe different states");
  }
}

}  // namespace

SavePlan plan_save(const std::shared_ptr<ProcessGroup>& group, const DistributedState& state) {
  const auto all = parse(all_gather_object(describe(state), CollectiveOptions().group(group)));
  std::vector<int64_t> load(group->size(), 0);
  auto least_loaded = [&](const std::vector<Entry>& holders) {
    const Entry* best = &holders.front();
    for (const auto& e : holders)
      if (load[e.rank] < load[best->rank]) best = &e;
    load[best->rank] += best->bytes;
    return best->rank;
  };
  SavePlan plan;
  for (const auto& [name, held] : all.replicated) {
    DTRAIN_CHECK_ARG(!all.sharded.count(name), "checkpoint::save: '", name, "' is replicated on rank ",
                     held.front().rank, " but sharded on rank ", all.sharded.at(name).front().rank,
                     "; the ranks describe different states");
    check_agree("replicated", name, held);
    plan.replicated_owner[name] = least_loaded(held);
  }
  for (const auto& [name, held] : all.sharded) {
    check_agree("sharded", name, held);
    plan.sharded_numel[name] = held.front().numel;
    if (!held.front().shape.empty()) plan.sharded_shape[name] = held.front().shape;
    if (!held.front().flat_shape.empty()) plan.flat_shape[name] = held.front().flat_shape;
    for (const auto& piece : distinct_pieces(name, held))
      if (least_loaded(piece) == group->rank()) plan.my_pieces.insert(name);
  }
  return plan;
}

}  // namespace dtrain::checkpoint::files
