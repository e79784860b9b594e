#include "store/read_budget.h"

namespace dtrain::store_detail {

// Whether the next read of `c` is covered: its buffer is reserved up to the
// end of a large request whose end is known (a dtrain header or the c10d
// scan tells), or one read's worth is free.
bool ReadBudget::covers_next_read(StoreConnection& c) {
  const size_t have = c.in.size();
  if (c.in_need <= have + kReadChunk) return io_.used() + kReadChunk <= io_.limit();
  const size_t most =
      c.dialect == c10d_wire::Dialect::kDtrain ? c.in_need : c10d_wire::kMaxRequestBytes;
  return c.in.reserve(c.in_need, most) || c.in.room() > 0;
}

void ReadBudget::start_waiting() {
  if (!anyone_waiting()) since_ = Clock::now();
}

// Connections already waiting come first.
bool ReadBudget::may_read(uint64_t id, StoreConnection& c) {
  if (c.budget_granted) {
    c.budget_granted = false;
    return true;
  }
  if (c.in_need > c.in.size() + kReadChunk && c.in.room() > 0) return true;  // reserved before
  if (readers_.empty() && covers_next_read(c)) return true;
  start_waiting();
  c.awaiting_budget = true;
  readers_.push_back(id);
  return false;
}

void ReadBudget::note_stalled(uint64_t id, StoreConnection& c) {
  if (c.stalled) return;
  start_waiting();
  c.stalled = true;
  stalled_.push_back(id);
}

// A reader let through is polled again, and its next read goes.
void ReadBudget::wake(StoreConnections& conns, std::vector<uint64_t>& resume) {
  while (!readers_.empty()) {
    auto it = conns.find(readers_.front());
    if (it == conns.end() || it->second.broken) {
      readers_.pop_front();
      continue;
    }
    StoreConnection& c = it->second;
    if (!covers_next_read(c)) break;
    c.awaiting_budget = false;
    c.budget_granted = true;
    readers_.pop_front();
  }
  if (io_.spent()) return;
  for (uint64_t id : stalled_) {
    auto it = conns.find(id);
    if (it == conns.end()) continue;
    it->second.stalled = false;
    resume.push_back(id);
  }
  stalled_.clear();
  if (readers_.empty()) since_ = {};
}

// A parked GET/WAIT waits for a key, not for its client: never named.
uint64_t ReadBudget::stalled_holder(const StoreConnections& conns,
                                    std::chrono::milliseconds stall_timeout, size_t& held) {
  held = 0;
  if (!anyone_waiting()) return 0;
  const auto now = Clock::now();
  if (now - since_ < stall_timeout) return 0;
  uint64_t victim = 0;
  for (const auto& [id, c] : conns) {
    const size_t holds = c.in.capacity() + c.pending_output();
    if (c.awaiting_budget || c.stalled || c.parked || c.broken || holds <= held) continue;
    if (now - c.last_progress < stall_timeout) continue;
    victim = id;
    held = holds;
  }
  since_ = now;  // next look in one stall_timeout
  return victim;
}

}  // namespace dtrain::store_detail
