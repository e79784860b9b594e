#include "store/tcp_store_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/enforce.h"
#include "common/logging.h"
#include "store/store_util.h"

// The server thread in words.
//
// Each turn of the loop polls the wakeup eventfd, the listening socket and
// every client socket. poll()'s timeout is the nearest deadline of a parked
// GET/WAIT, so expiring waiters needs neither a timer thread nor a sleep.
//
// Input: a readable socket is drained into that connection's input buffer,
// then complete frames are cut off the front and handled in order. A header
// is validated as soon as its 16 bytes are there, before the payload
// arrives, so a frame that declares 4 GiB is refused after 16 bytes; a
// partial frame simply waits in the buffer, so a client that sends half a
// header and stalls costs nothing but its buffer.
//
// Blocking requests: a GET or WAIT whose keys are missing becomes a Waiter
// and marks its connection parked; later frames from that connection stay
// in its buffer, which keeps replies in request order. Every operation that
// can create a key (SET, ADD, COMPARE_SET) re-checks the waiters; a waiter
// whose keys all exist is answered and its connection goes on the resume_
// list, which the loop drains after handling the poll events (handling a
// resumed connection may itself satisfy other waiters — the list, unlike
// recursion, takes that in its stride).
//
// Output: replies are appended to the connection's output buffer and sent at
// once as far as the socket accepts; the rest goes out when poll() says the
// socket is writable. A client that does not read its replies therefore
// blocks nobody; once its output backs up past kBackpressureBytes the server
// stops reading its requests until it catches up.

namespace dtrain {

using namespace store_detail;

namespace {

constexpr size_t kReadChunk = 64 * 1024;
// A client's unprocessed input and unsent output are each allowed to grow
// to one maximal frame (plus slack) before the server stops reading from it.
constexpr size_t kBackpressureBytes = size_t(TcpStore::kMaxFrameBytes) + 2 * kReadChunk;

std::string peer_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), serv,
                  sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return net::endpoint(host, static_cast<uint16_t>(std::atoi(serv)));
}

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port)
    : listener_(net::listen_on(host, port, &port_)) {
  where_ = net::endpoint(host, port_);
  const int flags = fcntl(listener_.get(), F_GETFL, 0);
  fcntl(listener_.get(), F_SETFL, flags | O_NONBLOCK);
  wakeup_ = net::Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wakeup_)
    throw NetworkError(detail::cat("TCP store ", where_, ": eventfd() failed: ",
                                   std::strerror(errno)));
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  stop_ = true;
  const uint64_t one = 1;
  ssize_t ignored = write(wakeup_.get(), &one, sizeof(one));
  (void)ignored;
  thread_.join();
  conns_.clear();  // closes every client socket
}

std::string TcpStoreServer::bound_address() const {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  char host[NI_MAXHOST];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), nullptr, 0,
                  NI_NUMERICHOST) != 0)
    return "";
  return host;
}

void TcpStoreServer::run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;  // ids[i] is the connection polled in fds[i + 2]
  while (!stop_) {
    fds.clear();
    ids.clear();
    fds.push_back({wakeup_.get(), POLLIN, 0});
    const bool accepting = Clock::now() >= accept_paused_until_;
    fds.push_back({accepting ? listener_.get() : -1, POLLIN, 0});
    for (auto& [id, c] : conns_) {
      short events = 0;
      // Backpressure: stop reading from a client that does not read its
      // replies, or that piles up requests behind a parked one.
      if (c.in.size() < kBackpressureBytes && c.out.size() - c.out_sent < kBackpressureBytes)
        events |= POLLIN;
      if (c.out_sent < c.out.size()) events |= POLLOUT;
      fds.push_back({c.fd.get(), events, 0});
      ids.push_back(id);
    }
    const int rc = ::poll(fds.data(), fds.size(), poll_timeout_ms());
    if (rc < 0 && errno != EINTR) {
      log_line(detail::cat("TCP store ", where_, ": poll() failed: ", std::strerror(errno),
                           "; server stopped"));
      return;
    }
    if (stop_) break;
    if (rc > 0) {
      if (fds[1].revents != 0) accept_clients();
      for (size_t i = 0; i < ids.size(); ++i) {
        const short ev = fds[i + 2].revents;
        if (ev == 0) continue;
        serve(ids[i], [&](Connection& c) {
          bool ok = true;
          if (ev & (POLLIN | POLLHUP | POLLERR)) ok = read_from(ids[i], c);
          if (ok && (ev & POLLOUT)) ok = flush(c);
          return ok;
        });
      }
    }
    expire_waiters();
    while (!resume_.empty()) {
      const uint64_t id = resume_.back();
      resume_.pop_back();
      serve(id, [&](Connection& c) { return process_input(id, c); });
    }
  }
}

// Runs one step for one connection and closes it when the step says so or
// fails: an exception (say, bad_alloc on a 64 MiB frame) costs that client
// its connection, never the server its thread.
template <typename Step>
void TcpStoreServer::serve(uint64_t id, Step step) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;  // closed earlier in this turn
  bool ok = false;
  try {
    ok = step(it->second);
  } catch (const std::exception& e) {
    log_line(detail::cat("TCP store ", where_, ": dropping client ", it->second.peer, ": ",
                         e.what()));
  }
  if (!ok) close_connection(id);
}

int TcpStoreServer::poll_timeout_ms() const {
  Clock::time_point next = Clock::time_point::max();
  for (const auto& w : waiters_) next = std::min(next, w.deadline);
  if (Clock::now() < accept_paused_until_) next = std::min(next, accept_paused_until_);
  if (next == Clock::time_point::max()) return -1;
  const auto left = next - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  return static_cast<int>(std::min<int64_t>(
      std::chrono::ceil<std::chrono::milliseconds>(left).count(), 1 << 30));
}

void TcpStoreServer::accept_clients() {
  for (;;) {
    const int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: the pending connection stays readable, so
        // polling the listener now would spin. Look again in 100 ms.
        log_line(detail::cat("TCP store ", where_, ": cannot accept: ", std::strerror(errno)));
        accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
      }
      return;  // EAGAIN: no more pending connections
    }
    net::Fd sock(fd);
    if (conns_.size() >= kMaxConnections) {
      log_line(detail::cat("TCP store ", where_, ": refusing ", peer_of(fd), ": already ",
                           kMaxConnections, " connections"));
      continue;  // closes it
    }
    Connection c;
    c.peer = peer_of(fd);
    c.fd = std::move(sock);
    conns_.emplace(next_conn_id_++, std::move(c));
  }
}

bool TcpStoreServer::read_from(uint64_t id, Connection& c) {
  uint8_t buf[kReadChunk];
  for (;;) {
    const ssize_t n = ::recv(c.fd.get(), buf, sizeof(buf), 0);
    if (n > 0) {
      c.in.insert(c.in.end(), buf, buf + n);
      if (static_cast<size_t>(n) < sizeof(buf) || c.in.size() >= kBackpressureBytes) break;
      continue;
    }
    if (n == 0) return false;  // the client closed
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    return false;              // reset by the peer
  }
  return process_input(id, c);
}

bool TcpStoreServer::process_input(uint64_t id, Connection& c) {
  if (c.dialect == c10d_wire::Dialect::kUnknown) {
    bool refused = false;
    c.dialect = c10d_wire::detect(c.in.data(), c.in.size(), &refused);
    if (refused) {
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping client ", c.peer,
                      ": it speaks neither dtrain's nor c10d's store protocol (first byte ",
                      int(c.in[0]), ")");
      return false;
    }
    if (c.dialect == c10d_wire::Dialect::kUnknown) return true;  // wait for more bytes
  }
  if (c.dialect != c10d_wire::Dialect::kDtrain) return process_c10d(id, c);
  size_t pos = 0;
  bool ok = true;
  while (ok && !c.parked && c.in.size() - pos >= wire::kHeaderBytes) {
    const wire::Header h = wire::decode_header(c.in.data() + pos);
    if (const char* problem = wire::header_problem(h, /*is_request=*/true)) {
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping client ", c.peer, ": ", problem,
                      " (opcode ", h.opcode, ", length ", h.length, ")");
      return false;
    }
    if (c.in.size() - pos - wire::kHeaderBytes < h.length) break;  // wait for the rest
    wire::Reader r(c.in.data() + pos + wire::kHeaderBytes, h.length);
    try {
      ok = handle(id, c, h, r);
    } catch (const wire::Malformed& m) {
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping client ", c.peer, ": malformed ",
                      wire::op_name(h.opcode), " request: ", m.what);
      return false;
    }
    pos += wire::kHeaderBytes + h.length;
  }
  c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(pos));
  return ok;
}

// Answers one request. A well-formed request the store must refuse (a key
// over the size limit, add() on a non-integer) gets an ERROR reply that the
// client throws as InvalidArgument; a malformed one throws wire::Malformed.
bool TcpStoreServer::handle(uint64_t id, Connection& c, const wire::Header& h,
                            wire::Reader& r) {
  wire::Writer ok(wire::kOk, h.request_id);
  auto check_key = [](const std::string& key) {
    DTRAIN_CHECK_ARG(key.size() <= wire::kMaxKeyBytes, "TCP store key of ", key.size(),
                     " bytes is over the limit of ", wire::kMaxKeyBytes, " bytes");
  };
  try {
    switch (h.opcode) {
      case wire::kSet: {
        std::string key = r.str();
        auto value = r.bytes();
        r.expect_end();
        check_key(key);
        data_[key] = std::move(value);
        key_added();
        break;
      }
      case wire::kGet:
      case wire::kWait: {
        const bool is_get = h.opcode == wire::kGet;
        std::vector<std::string> keys;
        uint32_t timeout_ms = 0;
        if (is_get) {
          keys.push_back(r.str());
          timeout_ms = r.u32();
        } else {
          timeout_ms = r.u32();
          const uint32_t n = r.count(4);
          keys.reserve(n);
          for (uint32_t i = 0; i < n; ++i) keys.push_back(r.str());
        }
        r.expect_end();
        for (const auto& k : keys) check_key(k);
        if (missing_keys(data_, keys).empty()) {
          if (is_get) ok.bytes(data_.at(keys[0]));
          break;
        }
        waiters_.push_back({id, h.request_id, is_get ? Waiter::kGet : Waiter::kWait, std::move(keys),
                            Clock::now() + std::chrono::milliseconds(timeout_ms)});
        parked_count_ = waiters_.size();
        c.parked = true;
        return true;  // answered later by key_added() or expire_waiters()
      }
      case wire::kAdd: {
        std::string key = r.str();
        const int64_t delta = r.i64();
        r.expect_end();
        check_key(key);
        ok.i64(apply_add(data_, key, delta));
        key_added();
        break;
      }
      case wire::kCompareSet: {
        std::string key = r.str();
        auto expected = r.bytes();
        auto desired = r.bytes();
        r.expect_end();
        check_key(key);
        bool changed = false;
        ok.bytes(apply_compare_set(data_, key, expected, desired, &changed));
        if (changed) key_added();
        break;
      }
      case wire::kCheck: {
        const uint32_t n = r.count(4);
        std::vector<std::string> keys;
        keys.reserve(n);
        for (uint32_t i = 0; i < n; ++i) keys.push_back(r.str());
        r.expect_end();
        ok.u32(missing_keys(data_, keys).empty() ? 1 : 0);
        break;
      }
      case wire::kDelete: {
        std::string key = r.str();
        r.expect_end();
        ok.u32(data_.erase(key) > 0 ? 1 : 0);
        break;
      }
      case wire::kNumKeys:
        r.expect_end();
        ok.i64(count_user_keys(data_));
        break;
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

void TcpStoreServer::reply(Connection& c, std::vector<uint8_t> frame) {
  if (c.out_sent == c.out.size()) {
    c.out = std::move(frame);
    c.out_sent = 0;
  } else {
    c.out.insert(c.out.end(), frame.begin(), frame.end());
  }
}

bool TcpStoreServer::flush(Connection& c) {
  while (c.out_sent < c.out.size()) {
    const ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_sent, c.out.size() - c.out_sent,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out_sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // POLLOUT later
    return false;
  }
  c.out.clear();
  c.out_sent = 0;
  return true;
}

void TcpStoreServer::close_connection(uint64_t id) {
  waiters_.erase(std::remove_if(waiters_.begin(), waiters_.end(),
                                [id](const Waiter& w) { return w.conn == id; }),
                 waiters_.end());
  parked_count_ = waiters_.size();
  conns_.erase(id);
}

// Takes the waiters matching `pred` off the list, keeping the others in
// arrival order.
template <typename Pred>
std::vector<TcpStoreServer::Waiter> TcpStoreServer::take_waiters(Pred pred) {
  auto split = std::stable_partition(waiters_.begin(), waiters_.end(),
                                     [&](const Waiter& w) { return !pred(w); });
  std::vector<Waiter> taken(std::make_move_iterator(split),
                            std::make_move_iterator(waiters_.end()));
  waiters_.erase(split, waiters_.end());
  parked_count_ = waiters_.size();
  return taken;
}

// A key may have appeared: answer every waiter whose keys all exist now.
void TcpStoreServer::key_added() {
  if (waiters_.empty()) return;
  for (const auto& w : take_waiters(
           [this](const Waiter& w) { return missing_keys(data_, w.keys).empty(); }))
    finish_waiter(w, false);
}

void TcpStoreServer::expire_waiters() {
  if (waiters_.empty()) return;
  const auto now = Clock::now();
  for (const auto& w : take_waiters([now](const Waiter& w) { return w.deadline <= now; }))
    finish_waiter(w, true);
}

// Replies to a waiter taken off the list and lets its connection go on with
// the requests that queued up behind it.
void TcpStoreServer::finish_waiter(const Waiter& w, bool timed_out) {
  auto it = conns_.find(w.conn);
  if (it == conns_.end()) return;
  Connection& c = it->second;
  if (w.kind == Waiter::kC10dWait) {
    reply(c, c10d_wire::Writer().u8(c10d_wire::kStopWaiting).take());
    if (!flush(c)) close_connection(w.conn);
    return;
  }
  if (timed_out) {
    reply(c, wire::Writer(wire::kTimeout, w.request_id).finish());
  } else {
    wire::Writer ok(wire::kOk, w.request_id);
    if (w.kind == Waiter::kGet) ok.bytes(data_.at(w.keys[0]));
    reply(c, ok.finish());
  }
  c.parked = false;
  if (!flush(c)) {
    close_connection(w.conn);
    return;
  }
  resume_.push_back(w.conn);
}

}  // namespace dtrain
