#include "store/waiter_table.h"

#include <algorithm>

namespace dtrain::store_detail {

void WaiterTable::park(Waiter w, const std::vector<std::string>& missing) {
  const uint64_t id = next_id_++;
  Entry e;
  e.by_deadline = by_deadline_.emplace(w.deadline, id);
  by_conn_[w.conn].insert(id);
  for (const auto& k : missing) {
    if (by_key_[k].insert(id).second) e.missing.push_back(k);  // a key listed twice counts once
  }
  e.left = e.missing.size();
  e.waiter = std::move(w);
  entries_.emplace(id, std::move(e));
}

std::vector<WaiterTable::Waiter> WaiterTable::key_set(const std::string& key) {
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return {};
  std::vector<uint64_t> ready;
  // A count, not a search of the waiter's key list: one WAIT on 131,072
  // keys followed by their SETs costs O(k), not O(k^2).
  for (uint64_t id : it->second)
    if (--entries_.at(id).left == 0) ready.push_back(id);
  by_key_.erase(it);
  std::sort(ready.begin(), ready.end());
  std::vector<Waiter> out;
  out.reserve(ready.size());
  for (uint64_t id : ready) out.push_back(take(id));
  return out;
}

std::vector<WaiterTable::Waiter> WaiterTable::expire(Clock::time_point now) {
  std::vector<uint64_t> due;
  for (auto it = by_deadline_.begin(); it != by_deadline_.end() && it->first <= now; ++it)
    due.push_back(it->second);
  std::sort(due.begin(), due.end());
  std::vector<Waiter> out;
  out.reserve(due.size());
  for (uint64_t id : due) out.push_back(take(id));
  return out;
}

void WaiterTable::drop_connection(uint64_t conn) {
  drop_if(conn, [](const Waiter&) { return true; });
}

void WaiterTable::drop_c10d_waits(uint64_t conn) {
  drop_if(conn, [](const Waiter& w) { return w.kind == Waiter::kC10dWait; });
}

template <typename Pred>
void WaiterTable::drop_if(uint64_t conn, Pred pred) {
  auto it = by_conn_.find(conn);
  if (it == by_conn_.end()) return;
  std::vector<uint64_t> ids;
  for (uint64_t id : it->second)
    if (pred(entries_.at(id).waiter)) ids.push_back(id);
  for (uint64_t id : ids) take(id);
}

WaiterTable::Clock::time_point WaiterTable::next_deadline() const {
  return by_deadline_.empty() ? Clock::time_point::max() : by_deadline_.begin()->first;
}

size_t WaiterTable::count_for(uint64_t conn) const {
  auto it = by_conn_.find(conn);
  return it == by_conn_.end() ? 0 : it->second.size();
}

// Removes one waiter from every index and returns it. (The index entries
// of keys already set are gone; another waiter's entry under such a key
// does not hold this id, so erasing it there is a no-op.)
WaiterTable::Waiter WaiterTable::take(uint64_t id) {
  auto node = entries_.extract(id);
  Entry& e = node.mapped();
  for (const auto& k : e.missing) {
    auto it = by_key_.find(k);
    if (it == by_key_.end()) continue;
    it->second.erase(id);
    if (it->second.empty()) by_key_.erase(it);
  }
  by_deadline_.erase(e.by_deadline);
  auto c = by_conn_.find(e.waiter.conn);
  c->second.erase(id);
  if (c->second.empty()) by_conn_.erase(c);
  return std::move(e.waiter);
}

}  // namespace dtrain::store_detail
