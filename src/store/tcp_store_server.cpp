#include "store/tcp_store_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <sys/socket.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "store/store_util.h"
#include "store/token_handshake.h"

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
// (store/waiter_table.h, indexed by the keys it misses) and marks its
// connection parked; later frames from that connection stay in its buffer,
// which keeps replies in request order. Every operation that stores a key
// tells the table, which hands back the waiters that had only that key
// left; a waiter whose keys all exist is answered and its connection goes
// on the resume_ list, which the loop drains after handling the poll events
// (handling a resumed connection may itself satisfy other waiters — the
// list, unlike recursion, takes that in its stride).
//
// Output: replies are appended to the connection's output queue and sent at
// once as far as the socket accepts; the rest goes out when poll() says the
// socket is writable. A GET's reply refers to the stored value instead of
// copying it. A client that does not read its replies therefore blocks
// nobody; once its unsent output reaches kMaxPendingOutput the server
// handles none of its buffered requests and reads no more of them until the
// output drains (then the connection is resumed). A blocked connection is
// still watched for POLLRDHUP, so a client that leaves is cleaned up.
//
// Memory: a connection's input buffer grows only as far as the request at
// its front needs (known from a dtrain header, or from the c10d scan), and
// only when the budget covers it; requests are handled only while the
// budget is not spent. A connection that must wait, to read or to handle,
// waits in the read budget's queues and is woken, first come first served,
// when replies drain or buffers shrink (store/read_budget.h).

namespace dtrain {

using namespace store_detail;

namespace {

// Reads of one connection in one turn, so that one fast client does not
// hold the loop while others wait.
constexpr int kReadsPerTurn = 64;

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

TcpStoreServer::Limits TcpStoreServer::Limits::from_environment() {
  Limits l;  // the handshake timeout keeps its default
  // Each rank holds a connection or two (its own store client, and under a
  // launcher the launcher's): a job of 4,096 ranks or more gets room.
  if (const auto world = env::get_int(env::kWorldSize, 1, 1 << 24))
    l.max_connections = std::max<size_t>(kMaxConnections, 2 * static_cast<size_t>(*world) + 64);
  l.max_bytes = static_cast<uint64_t>(*env::get_int(env::kStoreMaxBytes, 1 << 20, INT64_MAX));
  l.max_keys = static_cast<uint64_t>(*env::get_int(env::kStoreMaxKeys, 1024, INT64_MAX));
  return l;
}

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port, Limits limits,
                               std::optional<std::string> token)
    : limits_(limits), token_(std::move(token)), listener_(net::listen_on(host, port, &port_)),
      service_(limits.max_bytes, limits.max_keys, token_.has_value(), *this),
      budget_(limits.io_budget) {
  net::raise_open_file_limit();  // it serves a connection per rank (and agent)
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
      // Backpressure: no reading from a client that does not read its
      // replies, or whose requests wait behind a parked one.
      short events = POLLRDHUP;
      if (!c.blocked() && !c.awaiting_budget) events |= POLLIN;
      if (c.pending_output() > 0) events |= POLLOUT;
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
          // A client that closes while blocked: its requests will never be
          // handled, and reading them would only fill its buffer.
          if ((ev & POLLRDHUP) && (c.blocked() || c.awaiting_budget)) return false;
          if (ev & (POLLHUP | POLLERR)) return false;  // reset, or gone both ways
          bool ok = true;
          if (ev & (POLLIN | POLLRDHUP | POLLHUP | POLLERR)) ok = read_from(ids[i], c);
          if (ok && (ev & POLLOUT)) {
            const bool was_blocked = c.blocked();
            ok = flush(c);
            if (ok && was_blocked && !c.blocked()) resume_.push_back(ids[i]);
          }
          return ok;
        });
      }
    }
    service_.expire(Clock::now());
    close_stale_connections();
    close_stalled_holder();
    budget_.wake(conns_, resume_);
    while (!resume_.empty()) {
      const uint64_t id = resume_.back();
      resume_.pop_back();
      serve(id, [&](Connection& c) { return process_input(id, c); });
    }
    for (uint64_t id : doomed_) close_connection(id);
    doomed_.clear();
    peak_buffered_ = budget_.io().peak();
  }
}

// Runs one step for one connection and closes it when the step says so or
// fails: an exception (say, bad_alloc on a 64 MiB frame) costs that client
// its connection, never the server its thread.
template <typename Step>
void TcpStoreServer::serve(uint64_t id, Step step) {
  auto it = conns_.find(id);
  if (it == conns_.end() || it->second.broken) return;  // closed or closing
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
  Clock::time_point next = service_.next_deadline();
  if (!pending_.empty()) next = std::min(next, pending_.begin()->second + limits_.handshake_timeout);
  if (Clock::now() < accept_paused_until_) next = std::min(next, accept_paused_until_);
  if (budget_.anyone_waiting())  // look again for stalled holders
    next = std::min(next, std::max(budget_.waiting_since() + limits_.stall_timeout,
                                   Clock::now() + std::chrono::milliseconds(100)));
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
    // With a token, connections are counted against the cap only while
    // they have not proved it: the job's own processes are never refused.
    if (!token_ && established_ >= limits_.max_connections) {
      const std::string why = detail::cat("the store already has ", limits_.max_connections,
                                          " connections, its limit (4096, or twice WORLD_SIZE "
                                          "and 64 where the store runs)");
      log_line(detail::cat("TCP store ", where_, ": refusing ", peer_of(fd), ": ", why));
      const auto frame = wire::Writer(wire::kRefused, 0).str(why).finish();
      ssize_t ignored = ::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      (void)ignored;
      continue;  // closes it
    }
    if (pending_.size() >= max_pending()) make_room_for_pending();
    Connection c(&budget_.io());
    c.peer = peer_of(fd);
    c.fd = std::move(sock);
    c.opened = c.last_progress = Clock::now();
    pending_.emplace(next_conn_id_, c.opened);
    conns_.emplace(next_conn_id_++, std::move(c));
    conn_count_ = conns_.size();
  }
}

// Connections that have sent no well-formed request within
// Limits::handshake_timeout are closed: they hold a slot and a descriptor.
void TcpStoreServer::close_stale_connections() {
  const auto now = Clock::now();
  while (!pending_.empty() && pending_.begin()->second + limits_.handshake_timeout <= now) {
    const uint64_t id = pending_.begin()->first;
    const std::string why = detail::cat("no request within ", limits_.handshake_timeout.count(),
                                        " ms of connecting");
    DTRAIN_LOG_INFO("TCP store ", where_, ": closing ", conns_.at(id).peer, ": ", why);
    say_why(conns_.at(id), 0, why);
    close_connection(id);
  }
}

void TcpStoreServer::mark_established(uint64_t id, Connection& c) {
  if (c.established) return;
  c.established = true;
  ++established_;
  pending_.erase(id);
}

// Reads what the budget allows (may_read) and handles what arrived after
// each read: a header is looked at as soon as it is there (before the job
// token is proved, a frame the handshake does not allow is refused before
// its payload is read). The rest of a large request whose end is known is
// read straight into the connection's buffer; anything else goes through a
// 64 KiB scratch, so a connection holds only the bytes it has sent.
bool TcpStoreServer::read_from(uint64_t id, Connection& c) {
  uint8_t scratch[kReadChunk];
  for (int reads = 0; reads < kReadsPerTurn; ++reads) {
    if (c.in_need > budget_.io().limit()) {  // could never be buffered (a budget set below a frame)
      log_line(detail::cat("TCP store ", where_, ": dropping client ", c.peer, ": its request of ",
                           c.in_need, " bytes is more than the store's whole buffer budget (",
                           budget_.io().limit(), " bytes)"));
      return false;
    }
    if (c.broken || c.blocked() || c.awaiting_budget || !budget_.may_read(id, c)) return true;
    const bool direct = c.in_need > c.in.size() + kReadChunk;
    const size_t room = direct ? c.in.room() : sizeof(scratch);
    const ssize_t n = ::recv(c.fd.get(), direct ? c.in.tail() : scratch, room, 0);
    if (n > 0) {
      if (direct)
        c.in.grew(static_cast<size_t>(n));
      else
        c.in.append(scratch, static_cast<size_t>(n));
      c.last_progress = Clock::now();
      if (!process_input(id, c)) return false;
      if (static_cast<size_t>(n) < room) return true;
      continue;
    }
    if (n == 0) return false;  // the client closed
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;  // else reset by the peer
  }
  return true;
}

bool TcpStoreServer::process_input(uint64_t id, Connection& c) {
  if (c.dialect == c10d_wire::Dialect::kUnknown) {
    bool refused = false;
    c.dialect = c10d_wire::detect(c.in.data(), c.in.size(), &refused);
    if (refused) {
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping client ", c.peer,
                      ": it speaks neither dtrain's nor c10d's store protocol (first byte ",
                      int(c.in.data()[0]), ")");
      return false;
    }
    if (c.dialect == c10d_wire::Dialect::kUnknown) return true;  // wait for more bytes
    if (token_ && c.dialect != c10d_wire::Dialect::kDtrain) {
      refuse(c, "a PyTorch c10d client cannot prove the job token this store requires");
      return false;
    }
  }
  if (c.dialect != c10d_wire::Dialect::kDtrain) return process_c10d(id, c);
  size_t pos = 0;
  bool ok = true;
  c.in_need = 0;
  while (ok && !c.blocked() && c.in.size() - pos >= wire::kHeaderBytes) {
    const wire::Header h = wire::decode_header(c.in.data() + pos);
    if (const char* problem = wire::header_problem(h, /*is_request=*/true)) {
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping client ", c.peer, ": ", problem,
                      " (opcode ", h.opcode, ", length ", h.length, ")");
      return false;
    }
    if (token_ && !c.authenticated) {
      const std::string why = pre_auth_problem(c, h);
      if (!why.empty()) {
        refuse(c, why);
        say_why(c, h.request_id,
                h.opcode == wire::kAuthHello || h.opcode == wire::kAuthProof
                    ? why
                    : detail::cat("this store requires a job token, and this connection sent ",
                                  wire::op_name(h.opcode), " without proving it (is ",
                                  "DTRAIN_STORE_TOKEN set where the client runs?)"));
        return false;
      }
    }
    if (c.in.size() - pos - wire::kHeaderBytes < h.length) {  // wait for the rest
      c.in_need = wire::kHeaderBytes + h.length;
      break;
    }
    if (budget_.io().spent()) {  // handled once replies drain
      budget_.note_stalled(id, c);
      break;
    }
    wire::Reader r(c.in.data() + pos + wire::kHeaderBytes, h.length);
    try {
      const bool must_prove = token_ && !c.authenticated;
      if (must_prove) {
        ok = authenticate(c, h, r);
      } else {
        service_.handle(id, h, r);
        ok = flush(c);
      }
      if (ok && (!token_ || c.authenticated)) mark_established(id, c);
    } catch (const wire::Malformed& m) {
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping client ", c.peer, ": malformed ",
                      wire::op_name(h.opcode), " request: ", m.what);
      return false;
    }
    pos += wire::kHeaderBytes + h.length;
  }
  c.in.consume(pos);
  return ok;
}

// Handles every complete request in the buffer, in order. A request is
// scanned as its bytes arrive (c10d_wire::scan), and parsed once it is all there.
bool TcpStoreServer::process_c10d(uint64_t id, Connection& c) {
  size_t pos = 0;
  bool ok = true;
  c.in_need = 0;
  while (ok && pos < c.in.size() && !c.blocked()) {
    const uint8_t* start = c.in.data() + pos;
    const c10d_wire::Op op = c10d_wire::decode_op(c.dialect, *start);
    try {
      size_t need = 0;
      const size_t size = c10d_wire::scan(c.dialect, start, c.in.size() - pos, c.scan, &need);
      if (size == 0) {
        c.in_need = need;
        break;  // the rest of this request has not arrived yet
      }
      if (budget_.io().spent()) {  // handled once replies drain
        budget_.note_stalled(id, c);
        break;
      }
      c10d_wire::Reader r(start + 1, size - 1);
      ok = service_.handle_c10d(id, op, r);
      if (!ok)
        DTRAIN_LOG_INFO("TCP store ", where_, ": dropping c10d client ", c.peer, ": ",
                        c10d_wire::op_name(op), " is not supported by dtrain's store");
      mark_established(id, c);
      pos += size;
    } catch (const c10d_wire::Incomplete&) {  // a field its scan did not count: refuse, never wait
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping c10d client ", c.peer, ": ",
                      c10d_wire::op_name(op), " request shorter than its fields");
      return false;
    } catch (const wire::Malformed& m) {
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping c10d client ", c.peer, ": malformed ",
                      c10d_wire::op_name(op), " request: ", m.what);
      return false;
    } catch (const InvalidArgument& e) {  // add() on a non-integer: PyTorch drops it too
      DTRAIN_LOG_INFO("TCP store ", where_, ": dropping c10d client ", c.peer, ": ",
                      c10d_wire::op_name(op), ": ", e.what());
      return false;
    }
  }
  c.in.consume(pos);
  return ok && flush(c);
}

void TcpStoreServer::queue_reply(Connection& c, std::vector<uint8_t> head, SharedValue value) {
  c.out.append(std::move(head));
  if (value) c.out.append(std::move(value));
  if (c.pending_output() > peak_output_.load()) peak_output_ = c.pending_output();
}

// The service's answers. The connection handling a request is flushed by
// its caller once the request is done.
void TcpStoreServer::reply(uint64_t id, std::vector<uint8_t> head, SharedValue value) {
  queue_reply(conns_.at(id), std::move(head), std::move(value));
}

void TcpStoreServer::park(uint64_t id) { conns_.at(id).parked = true; }

// A parked request's answer, for a connection that may be another than the
// one whose request is being handled: sent at once, and an unparked
// connection goes on with its queued requests in this turn (resume_).
void TcpStoreServer::answer_parked(uint64_t id, std::vector<uint8_t> head, SharedValue value,
                                   bool unpark) {
  auto it = conns_.find(id);
  if (it == conns_.end() || it->second.broken) return;
  Connection& c = it->second;
  queue_reply(c, std::move(head), std::move(value));
  if (unpark) c.parked = false;
  if (!flush(c)) return doom(id, c);
  if (unpark) resume_.push_back(id);
}

bool TcpStoreServer::flush(Connection& c) {
  size_t sent = 0;
  const bool ok = c.out.flush(c.fd.get(), &sent);
  if (sent > 0) c.last_progress = Clock::now();
  return ok;
}

void TcpStoreServer::close_connection(uint64_t id) {
  service_.drop_connection(id);
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  if (it->second.established) --established_;
  pending_.erase(id);
  conns_.erase(it);
  conn_count_ = conns_.size();
}

// The connection is closed at the end of this turn of the loop, not now:
// its caller may be handling a request of that very connection.
void TcpStoreServer::doom(uint64_t id, Connection& c) {
  c.broken = true;
  doomed_.push_back(id);
}

// The job token's handshake (store/token_handshake.h): a refused
// connection is closed with nothing stored or revealed.
bool TcpStoreServer::authenticate(Connection& c, const wire::Header& h, wire::Reader& r) {
  auto step = handshake_step(c, *token_, h, r);
  if (!step.refusal.empty()) {
    refuse(c, step.refusal);
    if (!step.told.empty()) say_why(c, h.request_id, step.told);
    return false;
  }
  queue_reply(c, std::move(step.reply));
  return flush(c);
}

// While others have waited for the read budget for stall_timeout, the
// connection that holds most of it and has neither sent nor read for as
// long is closed, one per stall_timeout.
void TcpStoreServer::close_stalled_holder() {
  size_t held = 0;
  const uint64_t victim = budget_.stalled_holder(conns_, limits_.stall_timeout, held);
  if (victim == 0) return;
  log_line(detail::cat("TCP store ", where_, ": closing ", conns_.at(victim).peer, ": it holds ",
                       held, " bytes of the store's buffers and has neither sent nor read for ",
                       limits_.stall_timeout.count(), " ms while other clients wait for them (",
                       budget_.io().used(), " of ", budget_.io().limit(), " bytes in use)"));
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
  queue_reply(c, wire::Writer(wire::kRefused, request_id).str(why).finish());
  flush(c);
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
