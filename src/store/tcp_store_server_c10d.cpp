// The TCP store server's second dialect: PyTorch's c10d TCPStore clients
// (see store/c10d_wire.h). Same key-value map, same waiters, same limits as
// dtrain's own frames; only the bytes differ.
//
// Unlike a dtrain GET/WAIT, a parked c10d WAIT does not hold the
// connection: its client may send CANCEL_WAIT while it waits, which must be
// answered (WAIT_CANCELED) and must take the waiter away, so that no
// STOP_WAITING follows it.

#include <algorithm>

#include "common/enforce.h"
#include "common/logging.h"
#include "store/c10d_wire.h"
#include "store/store_util.h"
#include "store/tcp_store_server.h"

namespace dtrain {

using namespace store_detail;

namespace c10d_wire {

Dialect detect(const uint8_t* p, size_t n, bool* refused) {
  *refused = false;
  if (n == 0) return Dialect::kUnknown;
  if (p[0] == static_cast<uint8_t>(wire::kMagic & 0xff)) {  // 'D' of "DTRS"
    return Dialect::kDtrain;  // dtrain's header check refuses a wrong magic
  }
  if (p[0] == 0) {  // v2's VALIDATE, or v1's SET
    if (n < 5) return Dialect::kUnknown;
    uint32_t magic;
    std::memcpy(&magic, p + 1, sizeof(magic));
    return magic == kValidateMagic ? Dialect::kC10dV2 : Dialect::kC10dV1;
  }
  if (p[0] <= 8) return Dialect::kC10dV1;  // v2 clients always open with VALIDATE
  *refused = true;
  return Dialect::kUnknown;
}

Op decode_op(Dialect d, uint8_t b) {
  static const Op v1[] = {Op::kSet,   Op::kCompareSet, Op::kGet,      Op::kAdd,   Op::kCheck,
                          Op::kWait,  Op::kNumKeys,    Op::kWatchKey, Op::kDelete};
  static const Op v2[] = {Op::kValidate, Op::kSet,        Op::kCompareSet, Op::kGet,
                          Op::kAdd,      Op::kCheck,      Op::kWait,       Op::kNumKeys,
                          Op::kDelete,   Op::kAppend,     Op::kMultiGet,   Op::kMultiSet,
                          Op::kCancelWait, Op::kPing,     Op::kQueuePush,  Op::kQueuePop,
                          Op::kQueueLen, Op::kListKeys,   Op::kBarrier};
  if (d == Dialect::kC10dV1) return b < std::size(v1) ? v1[b] : Op::kInvalid;
  return b < std::size(v2) ? v2[b] : Op::kInvalid;
}

const char* op_name(Op op) {
  static const char* names[] = {
      "VALIDATE",   "SET",         "COMPARE_SET", "GET",       "ADD",        "CHECK",
      "WAIT",       "GETNUMKEYS",  "DELETE_KEY",  "APPEND",    "MULTI_GET",  "MULTI_SET",
      "CANCEL_WAIT", "PING",       "WATCH_KEY",   "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN",
      "LIST_KEYS",  "BARRIER",     "an unknown query type"};
  return names[static_cast<size_t>(op)];
}

namespace {

// The fields of each request after its query byte.
enum Field : uint8_t { kU32, kI64, kKey, kValue, kKeyList, kPairList, kEnd };

const Field* layout_of(Op op) {
  static const Field u32[] = {kU32, kEnd}, key_value[] = {kKey, kValue, kEnd},
                     pairs[] = {kPairList, kEnd}, cas[] = {kKey, kValue, kValue, kEnd},
                     add[] = {kKey, kI64, kEnd}, key[] = {kKey, kEnd}, keys[] = {kKeyList, kEnd},
                     none[] = {kEnd};
  switch (op) {
    case Op::kValidate:
    case Op::kPing: return u32;
    case Op::kSet:
    case Op::kAppend: return key_value;
    case Op::kMultiSet: return pairs;
    case Op::kCompareSet: return cas;
    case Op::kAdd: return add;
    case Op::kGet:
    case Op::kDelete: return key;
    case Op::kMultiGet:
    case Op::kCheck:
    case Op::kWait: return keys;
    default: return none;  // no fields, or not supported: the handler decides
  }
}

}  // namespace

size_t scan(Dialect d, const uint8_t* p, size_t n, Scan& s, size_t* need) {
  if (n == 0) {
    *need = 1;
    return 0;
  }
  const Field* layout = layout_of(decode_op(d, p[0]));
  if (s.pos == 0) s.pos = 1;
  auto u64_at = [&](uint64_t at) {
    uint64_t v;
    std::memcpy(&v, p + at, sizeof(v));
    return v;
  };
  for (;;) {
    Field f = layout[s.field];
    if (s.in_list) {
      if (s.items_left == 0) {
        s.in_list = false;
        ++s.field;
        continue;
      }
      f = f == kPairList && s.value_next ? kValue : kKey;
    }
    if (f == kEnd) {
      const size_t size = s.pos;
      s = Scan{};
      return size;
    }
    uint64_t end = s.pos + (f == kU32 ? 4 : 8);
    if (end > n) {
      *need = end;
      return 0;
    }
    if (f == kKey || f == kValue) {
      const uint64_t len = u64_at(s.pos);
      if (len > (f == kKey ? kMaxKeyBytes : kMaxValueBytes))
        throw wire::Malformed{f == kKey ? "key over the 64 KiB limit" : "value over the 64 MiB limit"};
      end += len;
    } else if (f == kKeyList || f == kPairList) {
      const uint64_t count = u64_at(s.pos);
      if (count > kMaxKeysPerRequest) throw wire::Malformed{"more than 131072 keys in one request"};
      s.in_list = true;
      s.items_left = count;
    }
    if (end > kMaxRequestBytes) throw wire::Malformed{"request over the 64 MiB limit"};
    if (end > n) {
      *need = end;
      return 0;
    }
    s.pos = end;
    if (!s.in_list || f == kKeyList || f == kPairList) {
      if (!s.in_list) ++s.field;
      continue;
    }
    if (layout[s.field] == kPairList && !s.value_next) {
      s.value_next = true;  // the pair's value
      continue;
    }
    s.value_next = false;
    --s.items_left;
  }
}

}  // namespace c10d_wire

namespace cw = c10d_wire;

// Handles every complete request in the buffer, in order. A request is
// scanned as its bytes arrive (cw::scan), and parsed once it is all there.
bool TcpStoreServer::process_c10d(uint64_t id, Connection& c) {
  size_t pos = 0;
  bool ok = true;
  c.in_need = 0;
  while (ok && pos < c.in.size() && !c.blocked()) {
    const uint8_t* start = c.in.data() + pos;
    const cw::Op op = cw::decode_op(c.dialect, *start);
    try {
      size_t need = 0;
      const size_t size = cw::scan(c.dialect, start, c.in.size() - pos, c.scan, &need);
      if (size == 0) {
        c.in_need = need;
        break;  // the rest of this request has not arrived yet
      }
      if (budget_.io().spent()) {  // handled once replies drain
        budget_.note_stalled(id, c);
        break;
      }
      cw::Reader r(start + 1, size - 1);
      ok = handle_c10d(id, c, op, r);
      mark_established(id, c);
      pos += size;
    } catch (const cw::Incomplete&) {  // a field its scan did not count: refuse, never wait
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping c10d client ", c.peer, ": ",
                      cw::op_name(op), " request shorter than its fields");
      return false;
    } catch (const wire::Malformed& m) {
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping c10d client ", c.peer, ": malformed ",
                      cw::op_name(op), " request: ", m.what);
      return false;
    } catch (const InvalidArgument& e) {  // add() on a non-integer: PyTorch drops it too
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping c10d client ", c.peer, ": ",
                      cw::op_name(op), ": ", e.what());
      return false;
    }
  }
  c.in.consume(pos);
  return ok && flush(c);
}

// Answers one c10d request whose query byte `r` has consumed. Throws
// Incomplete (nothing changed yet: every field is read before the map is
// touched) or Malformed.
bool TcpStoreServer::handle_c10d(uint64_t id, Connection& c, c10d_wire::Op op,
                                 c10d_wire::Reader& r) {
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
      auto now = store_compare_set(key, expected, desired);
      out.u64(now->size());
      reply(c, out.take(), std::move(now));
      break;
    }
    case cw::Op::kAdd: {
      std::string key = r.key();
      const int64_t delta = r.i64();
      out.i64(store_add(key, delta));
      break;
    }
    case cw::Op::kGet:
    case cw::Op::kMultiGet: {
      const auto keys = op == cw::Op::kGet ? std::vector<std::string>{r.key()} : r.keys();
      // Clients wait for their keys before they get them; a missing one
      // means the client is out of step, and PyTorch's server drops it too.
      const auto missing = table_.missing(keys);
      if (!missing.empty())
        throw wire::Malformed{"GET of a key that does not exist (the client did not WAIT)"};
      for (const auto& k : keys) {  // each value sent from the map's copy
        const auto& v = table_.at(k);
        out.u64(v->size());
        reply(c, out.take(), v);
      }
      break;
    }
    case cw::Op::kCheck:
      out.u8(table_.missing(r.keys()).empty() ? cw::kCheckReady : cw::kCheckNotReady);
      break;
    case cw::Op::kWait:
      c10d_wait(id, r, out);
      break;
    case cw::Op::kCancelWait:
      waiters_.drop_c10d_waits(id);
      parked_count_ = waiters_.size();
      out.u8(cw::kWaitCanceled);
      break;
    case cw::Op::kNumKeys:
      out.i64(table_.user_keys());
      break;
    case cw::Op::kDelete: {
      const std::string key = r.key();
      out.i64(table_.erase(key) ? 1 : 0);
      break;
    }
    case cw::Op::kListKeys:
      out.i64(table_.user_keys());
      for (const auto& [k, v] : table_.entries())
        if (!is_internal(k)) out.str(k);
      break;
    default:
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping c10d client ", c.peer, ": ",
                      cw::op_name(op), " is not supported by dtrain's store");
      return false;
  }
  if (!out.empty()) reply(c, out.take());
  return true;
}

// SET, APPEND and MULTI_SET: every field is read before the map changes.
void TcpStoreServer::c10d_store_values(c10d_wire::Op op, c10d_wire::Reader& r) {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> kv;
  const uint64_t n = op == cw::Op::kMultiSet ? r.count() : 1;
  for (uint64_t i = 0; i < n; ++i) {
    std::string key = r.key();
    kv.emplace_back(std::move(key), r.value());
  }
  std::vector<std::string> keys;
  for (const auto& kvp : kv) keys.push_back(kvp.first);
  table_.set_all(std::move(kv), op == cw::Op::kAppend, cw::kMaxValueBytes);
  for (const auto& key : keys) key_added(key);
}

// WAIT: answered now when every key exists, else parked without a deadline
// (the client times out and sends CANCEL_WAIT).
void TcpStoreServer::c10d_wait(uint64_t id, c10d_wire::Reader& r, c10d_wire::Writer& out) {
  auto keys = r.keys();
  if (table_.missing(keys).empty()) {
    out.u8(cw::kStopWaiting);
    return;
  }
  if (waiters_.count_for(id) >= kMaxWaitsPerConnection)
    throw wire::Malformed{"more than 64 WAITs parked on one connection"};
  Waiter w;
  w.conn = id;
  w.kind = Waiter::kC10dWait;
  w.keys = std::move(keys);
  park(std::move(w));
}

}  // namespace dtrain
