// What the TCP store's requests in dtrain's protocol do (store/wire.h):
// SET, GET, ADD, COMPARE_SET, WAIT, CHECK, DELETE and the rest against the
// key-value table, and GET and WAIT parked until their keys are stored or
// their deadline passes (store/waiter_table.h). Parked requests of both
// dialects are answered here.

#include "store/store_service.h"

#include "common/enforce.h"

namespace dtrain::store_detail {

namespace {

void check_key(const std::string& key) {
  DTRAIN_CHECK_ARG(key.size() <= wire::kMaxKeyBytes, "TCP store key of ", key.size(),
                   " bytes is over the limit of ", wire::kMaxKeyBytes, " bytes");
}

// A request's count-prefixed list of keys (WAIT, CHECK).
std::vector<std::string> read_keys(wire::Reader& r) {
  const uint32_t n = r.count(4);
  if (n > StoreService::kMaxKeysPerRequest)
    throw wire::Malformed{"more than 131072 keys in one request"};
  std::vector<std::string> keys;
  keys.reserve(n);
  for (uint32_t i = 0; i < n; ++i) keys.push_back(r.str());
  return keys;
}

// The head of a dtrain reply whose payload is one byte string of `n` bytes
// (a stored value, which follows it).
std::vector<uint8_t> value_head(uint16_t status, uint32_t request_id, size_t n) {
  return wire::Writer(status, request_id).u32(static_cast<uint32_t>(n)).finish(n);
}

}  // namespace

void StoreService::reply_value(uint64_t conn, uint16_t status, uint32_t request_id,
                               SharedValue value) {
  auto head = value_head(status, request_id, value->size());
  reply(conn, std::move(head), std::move(value));
}

// GET and WAIT: answered now when every key is there, else parked until
// key_added() or expire() answers them.
void StoreService::lookup(uint64_t conn, const wire::Header& h, wire::Reader& r) {
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
    if (is_get) reply_value(conn, wire::kOk, h.request_id, table_.at(keys[0]));
    else reply(conn, wire::Writer(wire::kOk, h.request_id).finish());
    return;
  }
  Waiter w;
  w.conn = conn;
  w.request_id = h.request_id;
  w.kind = is_get ? Waiter::kGet : Waiter::kWait;
  w.keys = std::move(keys);
  w.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  park(std::move(w));
  connections_.park(conn);
}

void StoreService::handle(uint64_t conn, const wire::Header& h, wire::Reader& r) {
  wire::Writer ok(wire::kOk, h.request_id);
  try {
    switch (h.opcode) {
      case wire::kSet: {
        std::string key = r.str();
        auto value = r.bytes();
        r.expect_end();
        check_key(key);
        table_.set(key, std::move(value));
        untie(key);  // (its own now: set again by someone)
        key_added(key);
        break;
      }
      case wire::kSetEphemeral: {
        std::string key = r.str();
        auto value = r.bytes();
        r.expect_end();
        check_key(key);
        set_ephemeral(conn, key, std::move(value));
        break;
      }
      case wire::kGet:
      case wire::kWait:
        return lookup(conn, h, r);
      case wire::kAdd: {
        std::string key = r.str();
        const int64_t delta = r.i64();
        r.expect_end();
        check_key(key);
        ok.i64(add(key, delta));
        break;
      }
      case wire::kCompareSet: {
        std::string key = r.str();
        auto expected = r.bytes();
        auto desired = r.bytes();
        r.expect_end();
        check_key(key);
        return reply_value(conn, wire::kOk, h.request_id, compare_set(key, expected, desired));
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
        untie(key);
        ok.u32(table_.erase(key) ? 1 : 0);
        break;
      }
      case wire::kNumKeys:
        r.expect_end();
        ok.i64(table_.user_keys());
        break;
      case wire::kAuthHello:
      case wire::kAuthProof:
        throw InvalidArgument(has_token_ ? "the job token was already proved on this connection"
                                         : "this store has no job token (DTRAIN_STORE_TOKEN is not "
                                           "set where it runs)");
      default:  // header_problem() has already refused unknown opcodes
        throw wire::Malformed{"an opcode that is no request"};
    }
  } catch (const InvalidArgument& e) {
    return reply(conn, wire::Writer(wire::kError, h.request_id).str(e.what()).finish());
  }
  reply(conn, ok.finish());
}

// ADD and COMPARE_SET in both dialects: applied to the table, and their
// waiters told.
int64_t StoreService::add(const std::string& key, int64_t delta) {
  const int64_t sum = table_.add(key, delta);
  key_added(key);
  return sum;
}

SharedValue StoreService::compare_set(const std::string& key, const Bytes& expected,
                                      const Bytes& desired) {
  bool changed = false;
  auto now = table_.compare_set(key, expected, desired, &changed);
  if (changed) key_added(key);
  return now;
}

// Parks a GET/WAIT whose keys are not all stored.
void StoreService::park(Waiter w) {
  const auto missing = table_.missing(w.keys);
  waiters_.park(std::move(w), missing);
  count_parked();
}

// `key` was stored: answer every waiter that now has all of its keys (the
// table proposes them; a key deleted since it was counted parks it again).
void StoreService::key_added(const std::string& key) {
  for (auto& w : waiters_.key_set(key)) {
    const auto missing = table_.missing(w.keys);
    if (missing.empty())
      finish(w, false);
    else
      waiters_.park(std::move(w), missing);
  }
  count_parked();
}

void StoreService::expire(Clock::time_point now) {
  for (const auto& w : waiters_.expire(now)) finish(w, true);
  count_parked();
}

// A key that lives as long as the connection that set it (ZooKeeper's
// ephemeral nodes): how a lighthouse learns at once that a replica's
// process is gone. Set again by another connection, it is that one's.
void StoreService::set_ephemeral(uint64_t conn, const std::string& key, Bytes value) {
  const auto mine = ephemeral_.find(conn);
  if (mine != ephemeral_.end() && !mine->second.count(key))
    DTRAIN_CHECK_ARG(mine->second.size() < kMaxEphemeralPerConnection, "a connection may hold at most ",
                     kMaxEphemeralPerConnection, " keys set with SET_EPHEMERAL");
  table_.set(key, std::move(value));
  untie(key);
  ephemeral_[conn].insert(key);
  owner_[key] = conn;
  key_added(key);
}

void StoreService::untie(const std::string& key) {
  auto it = owner_.find(key);
  if (it == owner_.end()) return;
  auto mine = ephemeral_.find(it->second);
  mine->second.erase(key);
  if (mine->second.empty()) ephemeral_.erase(mine);
  owner_.erase(it);
}

void StoreService::drop_connection(uint64_t conn) {
  waiters_.drop_connection(conn);
  count_parked();
  auto mine = ephemeral_.find(conn);
  if (mine == ephemeral_.end()) return;
  for (const auto& key : mine->second) {
    table_.erase(key);
    owner_.erase(key);
  }
  ephemeral_.erase(mine);
}

// Answers a waiter taken off the table. Its connection goes on with the
// requests that queued up behind it (a c10d WAIT held none).
void StoreService::finish(const Waiter& w, bool timed_out) {
  if (w.kind == Waiter::kC10dWait)
    return connections_.answer_parked(
        w.conn, c10d_wire::Writer().u8(c10d_wire::kStopWaiting).take(), nullptr, false);
  if (timed_out)
    return connections_.answer_parked(w.conn, wire::Writer(wire::kTimeout, w.request_id).finish(),
                                      nullptr, true);
  if (w.kind == Waiter::kWait)
    return connections_.answer_parked(w.conn, wire::Writer(wire::kOk, w.request_id).finish(),
                                      nullptr, true);
  const auto& value = table_.at(w.keys[0]);
  connections_.answer_parked(w.conn, value_head(wire::kOk, w.request_id, value->size()), value,
                             true);
}

}  // namespace dtrain::store_detail
