// What the TCP store's requests in dtrain's protocol do (store/wire.h):
// SET, GET, ADD, COMPARE_SET, WAIT, CHECK, DELETE and the rest against the
// key-value table, and GET and WAIT parked until their keys are stored or
// their deadline passes (store/waiter_table.h). The c10d dialect's
// requests come here too, through tcp_store_server_c10d.cpp.

#include "common/enforce.h"
#include "store/store_util.h"
#include "store/tcp_store_server.h"

namespace dtrain {

using namespace store_detail;

namespace {

void check_key(const std::string& key) {
  DTRAIN_CHECK_ARG(key.size() <= wire::kMaxKeyBytes, "TCP store key of ", key.size(),
                   " bytes is over the limit of ", wire::kMaxKeyBytes, " bytes");
}

// A request's count-prefixed list of keys (WAIT, CHECK).
std::vector<std::string> read_keys(wire::Reader& r) {
  const uint32_t n = r.count(4);
  if (n > TcpStoreServer::kMaxKeysPerRequest)
    throw wire::Malformed{"more than 131072 keys in one request"};
  std::vector<std::string> keys;
  keys.reserve(n);
  for (uint32_t i = 0; i < n; ++i) keys.push_back(r.str());
  return keys;
}

}  // namespace

// GET and WAIT: answered now when every key is there, else parked until
// key_added() or expire_waiters() answers them.
bool TcpStoreServer::handle_lookup(uint64_t id, Connection& c, const wire::Header& h,
                                   wire::Reader& r) {
  const bool is_get = h.opcode == wire::kGet;
  std::vector<std::string> keys;
  uint32_t timeout_ms = 0;
  if (is_get) {
    keys.push_back(r.str());
    timeout_ms = r.u32();
  } else {
    timeout_ms = r.u32();
    keys = read_keys(r);
  }
  r.expect_end();
  for (const auto& k : keys) check_key(k);
  if (table_.missing(keys).empty()) {
    if (is_get) reply_value(c, wire::kOk, h.request_id, table_.at(keys[0]));
    else reply(c, wire::Writer(wire::kOk, h.request_id).finish());
    return flush(c);
  }
  Waiter w;
  w.conn = id;
  w.request_id = h.request_id;
  w.kind = is_get ? Waiter::kGet : Waiter::kWait;
  w.keys = std::move(keys);
  w.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  park(std::move(w));
  c.parked = true;
  return true;
}

// Answers one request. A well-formed request the store must refuse (a key
// over the size limit, add() on a non-integer) gets an ERROR reply that the
// client throws as InvalidArgument; a malformed one throws wire::Malformed.
bool TcpStoreServer::handle(uint64_t id, Connection& c, const wire::Header& h,
                            wire::Reader& r) {
  wire::Writer ok(wire::kOk, h.request_id);
  try {
    switch (h.opcode) {
      case wire::kSet: {
        std::string key = r.str();
        auto value = r.bytes();
        r.expect_end();
        check_key(key);
        table_.set(key, std::move(value));
        key_added(key);
        break;
      }
      case wire::kGet:
      case wire::kWait:
        return handle_lookup(id, c, h, r);
      case wire::kAdd: {
        std::string key = r.str();
        const int64_t delta = r.i64();
        r.expect_end();
        check_key(key);
        ok.i64(store_add(key, delta));
        break;
      }
      case wire::kCompareSet: {
        std::string key = r.str();
        auto expected = r.bytes();
        auto desired = r.bytes();
        r.expect_end();
        check_key(key);
        reply_value(c, wire::kOk, h.request_id, store_compare_set(key, expected, desired));
        return flush(c);
      }
      case wire::kCheck: {
        const auto keys = read_keys(r);
        r.expect_end();
        ok.u32(table_.missing(keys).empty() ? 1 : 0);
        break;
      }
      case wire::kDelete: {
        std::string key = r.str();
        r.expect_end();
        ok.u32(table_.erase(key) ? 1 : 0);
        break;
      }
      case wire::kNumKeys:
        r.expect_end();
        ok.i64(table_.user_keys());
        break;
      case wire::kAuthHello:
      case wire::kAuthProof:
        throw InvalidArgument(token_ ? "the job token was already proved on this connection"
                                     : "this store has no job token (DTRAIN_STORE_TOKEN is not "
                                       "set where it runs)");
      default:  // header_problem() has already refused unknown opcodes
        return false;
    }
  } catch (const InvalidArgument& e) {
    reply(c, wire::Writer(wire::kError, h.request_id).str(e.what()).finish());
    return flush(c);
  }
  reply(c, ok.finish());
  return flush(c);
}

// ADD and COMPARE_SET in both dialects: applied to the table, and their
// waiters told.
int64_t TcpStoreServer::store_add(const std::string& key, int64_t delta) {
  const int64_t sum = table_.add(key, delta);
  key_added(key);
  return sum;
}

SharedValue TcpStoreServer::store_compare_set(const std::string& key,
                                              const std::vector<uint8_t>& expected,
                                              const std::vector<uint8_t>& desired) {
  bool changed = false;
  auto now = table_.compare_set(key, expected, desired, &changed);
  if (changed) key_added(key);
  return now;
}

// Parks a GET/WAIT whose keys are not all stored.
void TcpStoreServer::park(Waiter w) {
  const auto missing = table_.missing(w.keys);
  waiters_.park(std::move(w), missing);
  parked_count_ = waiters_.size();
}

// `key` was stored: answer every waiter that now has all of its keys (the
// table proposes them; a key deleted since it was counted parks it again).
void TcpStoreServer::key_added(const std::string& key) {
  for (auto& w : waiters_.key_set(key)) {
    const auto missing = table_.missing(w.keys);
    if (missing.empty())
      finish_waiter(w, false);
    else
      waiters_.park(std::move(w), missing);
  }
  parked_count_ = waiters_.size();
}

void TcpStoreServer::expire_waiters() {
  for (const auto& w : waiters_.expire(Clock::now())) finish_waiter(w, true);
  parked_count_ = waiters_.size();
}

// Replies to a waiter taken off the list and lets its connection go on with
// the requests that queued up behind it.
void TcpStoreServer::finish_waiter(const Waiter& w, bool timed_out) {
  auto it = conns_.find(w.conn);
  if (it == conns_.end()) return;
  Connection& c = it->second;
  if (c.broken) return;
  if (w.kind == Waiter::kC10dWait) {
    reply(c, c10d_wire::Writer().u8(c10d_wire::kStopWaiting).take());
    if (!flush(c)) doom(w.conn, c);
    return;
  }
  if (timed_out) {
    reply(c, wire::Writer(wire::kTimeout, w.request_id).finish());
  } else if (w.kind == Waiter::kGet) {
    reply_value(c, wire::kOk, w.request_id, table_.at(w.keys[0]));
  } else {
    reply(c, wire::Writer(wire::kOk, w.request_id).finish());
  }
  c.parked = false;
  if (!flush(c)) {
    doom(w.conn, c);
    return;
  }
  resume_.push_back(w.conn);
}

}  // namespace dtrain
