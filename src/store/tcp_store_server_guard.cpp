// The TCP store server's guards: the budget of bytes held for connections, room for
// new connections, the job token's challenge and response, and what a
// refused client and the log are told. (tcp_store_server.cpp has the loop.)

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "common/enforce.h"
#include "common/logging.h"
#include "store/store_util.h"
#include "store/tcp_store_server.h"

namespace dtrain {

using namespace store_detail;

namespace {
constexpr size_t kReadChunk = 64 * 1024;  // a read when the request's size is not known yet
}  // namespace

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

// The first frames of a connection to a store with a token: AUTH_HELLO,
// then AUTH_PROOF (store/auth.h). Anything else, or a wrong proof, is
// refused: the connection is closed with nothing stored or revealed.
bool TcpStoreServer::authenticate(Connection& c, const wire::Header& h, wire::Reader& r) {
  namespace auth = store_auth;
  if (h.opcode == wire::kAuthHello && !c.challenged) {
    const auto nonce = r.bytes();
    r.expect_end();
    if (nonce.size() != auth::kNonceBytes) throw wire::Malformed{"AUTH_HELLO nonce is not 32 bytes"};
    std::copy(nonce.begin(), nonce.end(), c.client_nonce.begin());
    c.server_nonce = auth::random_nonce();
    c.challenged = true;
    const auto mine = auth::proof(*token_, 'S', c.client_nonce, c.server_nonce);
    reply(c, wire::Writer(wire::kOk, h.request_id)
                 .bytes(c.server_nonce.data(), c.server_nonce.size())
                 .bytes(mine.data(), mine.size())
                 .finish());
    return flush(c);
  }
  if (h.opcode == wire::kAuthProof && c.challenged) {
    const auto got = r.bytes();
    r.expect_end();
    const auto want = auth::proof(*token_, 'C', c.server_nonce, c.client_nonce);
    if (!auth::matches(want, got.data(), got.size())) {
      refuse(c, "wrong job token");
      say_why(c, h.request_id, "wrong job token: its proof does not match this store's token");
      return false;
    }
    c.authenticated = true;
    reply(c, wire::Writer(wire::kOk, h.request_id).finish());
    return flush(c);
  }
  refuse(c, detail::cat("sent ", wire::op_name(h.opcode), " before proving the job token"));
  return false;
}

// Whether the next read of `c` is covered by the budget: its buffer is
// reserved up to the end of a large request whose end is known (a dtrain
// header or the c10d scan tells), or one read's worth is free.
bool TcpStoreServer::cover_next_read(Connection& c) {
  const size_t have = c.in.size();
  if (c.in_need <= have + kReadChunk) return budget_.used() + kReadChunk <= budget_.limit();
  const size_t most =
      c.dialect == c10d_wire::Dialect::kDtrain ? c.in_need : c10d_wire::kMaxRequestBytes;
  return c.in.reserve(c.in_need, most) || c.in.room() > 0;
}

// Whether `c` may read now; if not, it waits its turn on budget_queue_
// (connections already waiting come first).
bool TcpStoreServer::may_read(uint64_t id, Connection& c) {
  if (c.budget_granted) {
    c.budget_granted = false;
    return true;
  }
  if (c.in_need > c.in.size() + kReadChunk && c.in.room() > 0) return true;  // reserved before
  if (budget_queue_.empty() && cover_next_read(c)) return true;
  if (budget_queue_.empty() && stalled_.empty()) budget_wait_since_ = Clock::now();
  c.awaiting_budget = true;
  budget_queue_.push_back(id);
  return false;
}

// Requests are handled only while the budget is not spent; a connection
// with a whole request left then waits on stalled_.
void TcpStoreServer::note_stalled(uint64_t id, Connection& c) {
  if (c.stalled) return;
  if (budget_queue_.empty() && stalled_.empty()) budget_wait_since_ = Clock::now();
  c.stalled = true;
  stalled_.push_back(id);
}

// Once per turn: connections waiting for the budget go on, in the order
// they came, as far as it covers them (a reader is polled again, and its
// next read is let through).
void TcpStoreServer::wake_budget_waiters() {
  while (!budget_queue_.empty()) {
    auto it = conns_.find(budget_queue_.front());
    if (it == conns_.end() || it->second.broken) {
      budget_queue_.pop_front();
      continue;
    }
    Connection& c = it->second;
    if (!cover_next_read(c)) break;
    c.awaiting_budget = false;
    c.budget_granted = true;
    budget_queue_.pop_front();
  }
  if (budget_.spent()) return;
  for (uint64_t id : stalled_) {
    auto it = conns_.find(id);
    if (it == conns_.end()) continue;
    it->second.stalled = false;
    resume_.push_back(id);
  }
  stalled_.clear();
  if (budget_queue_.empty()) budget_wait_since_ = {};
}

// While others have waited for the budget for stall_timeout, the
// connection that holds most of it and has neither sent nor read for as
// long is closed, one per stall_timeout: a client that never reads its
// replies, or that sends half a request and stops, cannot hold the store.
void TcpStoreServer::close_stalled_holders() {
  if (budget_queue_.empty() && stalled_.empty()) return;
  const auto now = Clock::now();
  if (now - budget_wait_since_ < limits_.stall_timeout) return;
  uint64_t victim = 0;
  size_t most = 0;
  for (auto& [id, c] : conns_) {
    const size_t held = c.in.capacity() + c.pending_output();
    // A parked GET/WAIT waits for a key, not for its client: never taken.
    if (c.awaiting_budget || c.stalled || c.parked || c.broken || held <= most) continue;
    if (now - c.last_progress < limits_.stall_timeout) continue;
    victim = id;
    most = held;
  }
  budget_wait_since_ = now;  // next look in one stall_timeout
  if (victim == 0) return;
  log_line(detail::cat("TCP store ", where_, ": closing ", conns_.at(victim).peer, ": it holds ",
                       most, " bytes of the store's buffers and has neither sent nor read for ",
                       limits_.stall_timeout.count(), " ms while other clients wait for them (",
                       budget_.used(), " of ", budget_.limit(), " bytes in use)"));
  close_connection(victim);
}

size_t TcpStoreServer::max_pending() const {
  return std::max(kMaxPending, limits_.max_connections);
}

// Too many connections have made no request yet: the oldest one that has
// not sent a byte goes (a job's rank sends its first request, or the job
// token's AUTH_HELLO, as soon as it connects, so in a burst of thousands
// of ranks the silent ones are strangers), else the oldest. Established
// connections, which have proved the token where there is one, are never
// taken.
void TcpStoreServer::make_room_for_pending() {
  uint64_t victim = pending_.begin()->first;
  for (const auto& [id, opened] : pending_) {
    const Connection& c = conns_.at(id);
    char byte;
    if (!c.in.empty() || c.challenged) continue;
    if (::recv(c.fd.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) < 0 && errno == EAGAIN) {
      victim = id;
      break;
    }
  }
  const std::string why = detail::cat("it had made no request yet, and ", max_pending(),
                                      " such connections were open");
  DTRAIN_LOG_INFO("TCP store ", where_, ": closing ", conns_.at(victim).peer, ": ", why);
  say_why(conns_.at(victim), 0, why);
  close_connection(victim);
}

// The last frame of a connection the server closes (REFUSED), for a
// dtrain client to report; c10d clients, which would not understand it,
// get none.
void TcpStoreServer::say_why(Connection& c, uint32_t request_id, const std::string& why) {
  if (c.dialect != c10d_wire::Dialect::kDtrain && c.dialect != c10d_wire::Dialect::kUnknown) return;
  reply(c, wire::Writer(wire::kRefused, request_id).str(why).finish());
  flush(c);
}

// Before the proof only the next frame of the handshake is allowed, and no
// longer than that frame can be, so a stranger's declared 64 MiB is refused
// after 16 bytes instead of being buffered (256 pending connections would
// otherwise hold 16 GiB).
std::string TcpStoreServer::pre_auth_problem(const Connection& c, const wire::Header& h) const {
  const uint16_t expected = c.challenged ? wire::kAuthProof : wire::kAuthHello;
  if (h.opcode != expected)
    return detail::cat("sent ", wire::op_name(h.opcode), " (", h.length,
                       " bytes) before proving the job token");
  const size_t most = 4 + (c.challenged ? store_auth::kProofBytes : store_auth::kNonceBytes);
  if (h.length > most)
    return detail::cat("declared an ", wire::op_name(h.opcode), " of ", h.length,
                       " bytes (the handshake's are at most ", most, ")");
  return {};
}

// One log line per second at most, so a scan of the port cannot flood the
// log; the count of refusals not logged goes with the next line.
void TcpStoreServer::refuse(const Connection& c, const std::string& why) {
  const auto now = Clock::now();
  if (now - last_refusal_log_ < std::chrono::seconds(1)) {
    ++refusals_unlogged_;
    return;
  }
  log_line(detail::cat("TCP store ", where_, ": refused ", c.peer, ": ", why,
                       refusals_unlogged_ ? detail::cat(" (and ", refusals_unlogged_,
                                                        " more refusals in the last second)")
                                          : std::string()));
  last_refusal_log_ = now;
  refusals_unlogged_ = 0;
}

}  // namespace dtrain
