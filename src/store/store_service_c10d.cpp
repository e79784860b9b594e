// The TCP store's second dialect: what PyTorch's c10d TCPStore clients'
// requests do (store/c10d_wire.h). Same key-value table, same waiters, same
// limits as dtrain's own frames; only the bytes differ.
//
// Unlike a dtrain GET/WAIT, a parked c10d WAIT does not hold the
// connection: its client may send CANCEL_WAIT while it waits, which must be
// answered (WAIT_CANCELED) and must take the waiter away, so that no
// STOP_WAITING follows it.

#include "store/store_service.h"

namespace dtrain::store_detail {

namespace cw = c10d_wire;

bool StoreService::handle_c10d(uint64_t conn, cw::Op op, cw::Reader& r) {
  cw::Writer out;
  switch (op) {
    case cw::Op::kValidate:
      if (r.u32() != cw::kValidateMagic) throw wire::Malformed{"wrong VALIDATE magic"};
      break;
    case cw::Op::kPing:
      out.u32(r.u32());
      break;
    case cw::Op::kSet:
    case cw::Op::kAppend:
    case cw::Op::kMultiSet:
      c10d_store_values(op, r);
      break;
    case cw::Op::kCompareSet: {
      std::string key = r.key();
      auto expected = r.value();
      auto desired = r.value();
      auto now = compare_set(key, expected, desired);
      out.u64(now->size());
      reply(conn, out.take(), std::move(now));
      break;
    }
    case cw::Op::kAdd: {
      std::string key = r.key();
      const int64_t delta = r.i64();
      out.i64(add(key, delta));
      break;
    }
    case cw::Op::kGet:
    case cw::Op::kMultiGet: {
      const auto keys = op == cw::Op::kGet ? std::vector<std::string>{r.key()} : r.keys();
      // Clients wait for their keys before they get them; a missing one
      // means the client is out of step, and PyTorch's server drops it too.
      if (!table_.missing(keys).empty())
        throw wire::Malformed{"GET of a key that does not exist (the client did not WAIT)"};
      for (const auto& k : keys) {  // each value sent from the table's copy
        const auto& v = table_.at(k);
        out.u64(v->size());
        reply(conn, out.take(), v);
      }
      break;
    }
    case cw::Op::kCheck:
      out.u8(table_.missing(r.keys()).empty() ? cw::kCheckReady : cw::kCheckNotReady);
      break;
    case cw::Op::kWait:
      c10d_wait(conn, r, out);
      break;
    case cw::Op::kCancelWait:
      waiters_.drop_c10d_waits(conn);
      count_parked();
      out.u8(cw::kWaitCanceled);
      break;
    case cw::Op::kNumKeys:
      out.i64(table_.user_keys());
      break;
    case cw::Op::kDelete: {
      const std::string key = r.key();
      untie(key);
      out.i64(table_.erase(key) ? 1 : 0);
      break;
    }
    case cw::Op::kListKeys:
      out.i64(table_.user_keys());
      for (const auto& [k, v] : table_.entries())
        if (!is_internal(k)) out.str(k);
      break;
    default:
      return false;
  }
  if (!out.empty()) reply(conn, out.take());
  return true;
}

// SET, APPEND and MULTI_SET: every field is read before the table changes.
void StoreService::c10d_store_values(cw::Op op, cw::Reader& r) {
  std::vector<std::pair<std::string, Bytes>> kv;
  const uint64_t n = op == cw::Op::kMultiSet ? r.count() : 1;
  for (uint64_t i = 0; i < n; ++i) {
    std::string key = r.key();
    kv.emplace_back(std::move(key), r.value());
  }
  std::vector<std::string> keys;
  for (const auto& kvp : kv) keys.push_back(kvp.first);
  table_.set_all(std::move(kv), op == cw::Op::kAppend, cw::kMaxValueBytes);
  for (const auto& key : keys) {
    untie(key);
    key_added(key);
  }
}

// WAIT: answered now when every key exists, else parked without a deadline
// (the client times out and sends CANCEL_WAIT).
void StoreService::c10d_wait(uint64_t conn, cw::Reader& r, cw::Writer& out) {
  auto keys = r.keys();
  if (table_.missing(keys).empty()) {
    out.u8(cw::kStopWaiting);
    return;
  }
  if (waiters_.count_for(conn) >= kMaxWaitsPerConnection)
    throw wire::Malformed{"more than 64 WAITs parked on one connection"};
  Waiter w;
  w.conn = conn;
  w.kind = Waiter::kC10dWait;
  w.keys = std::move(keys);
  park(std::move(w));
}

}  // namespace dtrain::store_detail
