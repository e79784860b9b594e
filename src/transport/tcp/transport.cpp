// The TCP transport's data path (see transport.h for the design, mesh.cpp
// for connection setup).

#include "transport/tcp/transport.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <optional>
#include <cerrno>
#include <algorithm>
#include <cstring>
#include <thread>

#include "common/enforce.h"
#include "common/logging.h"
#include "transport/tcp/connection.h"
#include "transport/tcp/mesh.h"

namespace dtrain::transport::tcp {

PartRange part_range(size_t total, int streams, int s) {
  if (streams == 1 || total < kSplitBytes) return s == 0 ? PartRange{0, total, true}
                                                         : PartRange{0, 0, false};
  auto cut = [&](int i) -> size_t {
    if (i == streams) return total;
    return (total / streams * i) & ~size_t{63};  // cache-line aligned cuts
  };
  return {cut(s), cut(s + 1) - cut(s), true};
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(Mesh mesh, int rank, int size, const TcpOptions& options);
  ~TcpTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override;
  RequestPtr irecv_any(uint64_t tag, void* data, size_t bytes) override;
  void fail(std::exception_ptr error) override;
  std::exception_ptr error() const override {
    std::lock_guard<std::mutex> lock(error_mutex_);
    return error_;
  }
  const std::string& peer_name(int peer) const {
    static const std::string any = "any rank";
    return peer < 0 ? any : conns_[peer][0]->name;
  }

 private:
  using Parts = std::vector<std::pair<Connection*, Part>>;
  Parts split(int peer, uint64_t tag, uint8_t* data, size_t bytes,
              const std::shared_ptr<TcpRequest>& request, const char* op);
  void post_send(Connection& c, Part part);
  void post_recv(Connection& c, Part part);
  // Removes `request` from the unmatched irecv_any list; false when it was
  // matched (or failed) meanwhile. Takes any_mutex_.
  std::optional<AnyReceive> take_any(const std::shared_ptr<TcpRequest>& request);
  // On `c` (stream 0, its mutex held): the first unmatched irecv_any for
  // `tag`, bound to c's peer; its part for `c` is returned, the others go
  // to c.deferred. nullopt when there is none.
  std::optional<Part> match_any(Connection& c, uint64_t tag);
  void post_deferred(Connection& c);
  void serve(int stream);
  void on_event(Connection& c, uint32_t events);
  bool flush(Connection& c);            // true when the send queue is empty
  bool receive(Connection& c);          // false when the connection broke
  void start_message(Connection& c);
  void finish_message(Connection& c);
  void watch_out(Connection& c, bool on);
  // Marks the connection dead and fails what is queued on it; returns true
  // when something was pending (the transport must then fail too).
  bool kill(Connection& c, std::exception_ptr error);

  const int rank_, size_;
  const TcpOptions options_;
  std::vector<std::vector<std::unique_ptr<Connection>>> conns_;  // [peer][stream]
  std::vector<int> epoll_fds_;
  int stop_fd_ = -1;
  std::vector<std::thread> threads_;
  mutable std::mutex error_mutex_;
  std::exception_ptr error_;
  // Unmatched irecv_any requests, in posting order. Lock order: a
  // connection's mutex, then any_mutex_.
  std::mutex any_mutex_;
  std::list<AnyReceive> any_;
  std::atomic<size_t> any_count_{0};
};

// ---- requests -------------------------------------------------------------

void TcpRequest::part_done() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (--remaining_ == 0) cv_.notify_all();
}

void TcpRequest::fail(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) error_ = std::move(error);
  cv_.notify_all();
}

void TcpRequest::wait(Clock::time_point deadline, const std::string& what) {
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    const bool done =
        cv_.wait_until(lock, deadline, [&] { return remaining_ == 0 || error_ != nullptr; });
    if (done && !error_) return;
    error = error_;
  }
  if (!error)
    error = std::make_exception_ptr(TimeoutError(detail::cat(
        what, " timed out waiting for ", transport_.peer_name(peer_),
        " (it may be stopped, overloaded, or waiting in a different collective)")));
  transport_.fail(error);
  std::rethrow_exception(transport_.error());
}

// ---- setup and teardown ---------------------------------------------------

TcpTransport::TcpTransport(Mesh mesh, int rank, int size, const TcpOptions& options)
    : rank_(rank), size_(size), options_(options) {
  stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd_ < 0) throw NetworkError(detail::cat("tcp: eventfd failed: ", strerror(errno)));
  for (int s = 0; s < options.streams; ++s) {
    const int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) throw NetworkError(detail::cat("tcp: epoll_create1 failed: ", strerror(errno)));
    epoll_fds_.push_back(ep);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;  // the stop signal
    epoll_ctl(ep, EPOLL_CTL_ADD, stop_fd_, &ev);
  }
  conns_.resize(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    for (int s = 0; s < options.streams; ++s) {
      auto c = std::make_unique<Connection>();
      c->fd = std::move(mesh.conns[p][s]);
      c->peer = p;
      c->stream = s;
      c->epoll_fd = epoll_fds_[s];
      c->name = mesh.peer_names[p];
      const int flags = fcntl(c->fd.get(), F_GETFL);
      fcntl(c->fd.get(), F_SETFL, flags | O_NONBLOCK);
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = c.get();
      epoll_ctl(c->epoll_fd, EPOLL_CTL_ADD, c->fd.get(), &ev);
      conns_[p].push_back(std::move(c));
    }
  }
  for (int s = 0; s < options.streams; ++s) threads_.emplace_back([this, s] { serve(s); });
}

TcpTransport::~TcpTransport() {
  const uint64_t one = 1;
  (void)!::write(stop_fd_, &one, sizeof(one));
  for (auto& t : threads_) t.join();
  fail(std::make_exception_ptr(
      NetworkError(detail::cat("tcp: group '", options_.name, "' was destroyed"))));
  for (int ep : epoll_fds_) ::close(ep);
  ::close(stop_fd_);
}

void TcpTransport::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (error_) return;
    error_ = error;
  }
  bool timeout = false;
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError&) {
    timeout = true;
  } catch (...) {
  }
  {
    std::lock_guard<std::mutex> lock(any_mutex_);
    for (auto& a : any_) a.request->fail(error);
    any_.clear();
    any_count_ = 0;
  }
  for (auto& peer : conns_) {
    for (auto& c : peer) {
      std::lock_guard<std::mutex> lock(c->mutex);
      kill(*c, error);
      // Tell the peers at once, unless we merely gave up waiting (they
      // then time out themselves, with their own view of who is late).
      if (!timeout) ::shutdown(c->fd.get(), SHUT_RDWR);
    }
  }
}

bool TcpTransport::kill(Connection& c, std::exception_ptr error) {
  if (!c.dead) {
    c.dead = error;
    epoll_ctl(c.epoll_fd, EPOLL_CTL_DEL, c.fd.get(), nullptr);
  }
  bool pending = false;
  auto fail_part = [&](Part& p) {
    if (p.request) p.request->fail(error);
    pending = true;
  };
  for (auto& p : c.sendq) fail_part(p);
  for (auto& p : c.recvq) fail_part(p);
  if (c.in_message && c.current.request) fail_part(c.current);
  for (auto& h : c.held)
    if (h.waiter) fail_part(*h.waiter);
  c.sendq.clear();
  c.recvq.clear();
  c.current = Part{};
  c.current_held = nullptr;
  c.in_message = false;
  // Complete held messages stay: a receive may still claim them.
  for (auto it = c.held.begin(); it != c.held.end();)
    it = it->complete ? std::next(it) : c.held.erase(it);
  return pending;
}

// ---- posting --------------------------------------------------------------

TcpTransport::Parts TcpTransport::split(int peer, uint64_t tag, uint8_t* data, size_t bytes,
                                        const std::shared_ptr<TcpRequest>& request,
                                        const char* op) {
  DTRAIN_CHECK_ARG(peer >= 0 && peer < size_ && peer != rank_, "tcp: ", op, " with peer ", peer,
                   " on rank ", rank_, " of ", size_);
  Parts parts;
  for (int s = 0; s < options_.streams; ++s) {
    const auto range = part_range(bytes, options_.streams, s);
    if (!range.present) continue;
    Part p;
    p.data = data + range.offset;
    p.bytes = range.bytes;
    p.tag = tag;
    p.total = bytes;
    p.request = request;
    parts.emplace_back(conns_[peer][s].get(), std::move(p));
  }
  return parts;
}

RequestPtr TcpTransport::isend(int peer, uint64_t tag, const void* data, size_t bytes) {
  if (auto e = error()) std::rethrow_exception(e);
  const int n = bytes >= kSplitBytes ? options_.streams : 1;
  auto request = std::make_shared<TcpRequest>(*this, peer, n);
  for (auto& [c, part] : split(peer, tag, static_cast<uint8_t*>(const_cast<void*>(data)), bytes,
                               request, "isend"))
    post_send(*c, std::move(part));
  return request;
}

RequestPtr TcpTransport::irecv(int peer, uint64_t tag, void* data, size_t bytes) {
  if (auto e = error()) std::rethrow_exception(e);
  const int n = bytes >= kSplitBytes ? options_.streams : 1;
  auto request = std::make_shared<TcpRequest>(*this, peer, n);
  for (auto& [c, part] : split(peer, tag, static_cast<uint8_t*>(data), bytes, request, "irecv"))
    post_recv(*c, std::move(part));
  return request;
}

RequestPtr TcpTransport::irecv_any(uint64_t tag, void* data, size_t bytes) {
  if (auto e = error()) std::rethrow_exception(e);
  DTRAIN_CHECK_ARG(size_ > 1, "tcp: a receive from any rank in a group of one rank");
  const int n = bytes >= kSplitBytes ? options_.streams : 1;
  auto request = std::make_shared<TcpRequest>(*this, -1, n);
  {
    std::lock_guard<std::mutex> lock(any_mutex_);
    any_.push_back({tag, static_cast<uint8_t*>(data), bytes, request});
    ++any_count_;
  }
  // A message that is already here (held on a peer's first stream, where
  // every message has its first part) binds the receive to that peer now;
  // otherwise the I/O thread of the first one to arrive binds it.
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Connection& c = *conns_[p][0];
    std::unique_lock<std::mutex> lock(c.mutex);
    const bool here = std::any_of(c.held.begin(), c.held.end(), [&](const Held& h) {
      return h.tag == tag && !h.waiter;
    });
    if (!here) continue;
    auto mine = take_any(request);
    lock.unlock();
    if (!mine) break;  // an I/O thread matched it meanwhile
    request->bind(p);
    for (auto& [conn, part] : split(p, tag, mine->data, mine->bytes, request, "irecv"))
      post_recv(*conn, std::move(part));
    break;
  }
  if (auto e = error()) {  // failed meanwhile: fail() may have missed it
    if (take_any(request)) request->fail(e);
  }
  return request;
}

std::optional<AnyReceive> TcpTransport::take_any(const std::shared_ptr<TcpRequest>& request) {
  std::lock_guard<std::mutex> lock(any_mutex_);
  for (auto it = any_.begin(); it != any_.end(); ++it) {
    if (it->request != request) continue;
    AnyReceive a = std::move(*it);
    any_.erase(it);
    --any_count_;
    return a;
  }
  return std::nullopt;
}

std::optional<Part> TcpTransport::match_any(Connection& c, uint64_t tag) {
  if (c.stream != 0 || any_count_.load() == 0) return std::nullopt;
  AnyReceive a;
  {
    std::lock_guard<std::mutex> lock(any_mutex_);
    auto it = std::find_if(any_.begin(), any_.end(), [&](const AnyReceive& r) { return r.tag == tag; });
    if (it == any_.end()) return std::nullopt;
    a = std::move(*it);
    any_.erase(it);
    --any_count_;
  }
  a.request->bind(c.peer);
  std::optional<Part> mine;
  for (auto& [conn, part] : split(c.peer, tag, a.data, a.bytes, a.request, "irecv")) {
    if (conn == &c) mine = std::move(part);
    else c.deferred.emplace_back(conn, std::move(part));
  }
  return mine;
}

void TcpTransport::post_deferred(Connection& c) {
  std::vector<std::pair<Connection*, Part>> parts;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    parts.swap(c.deferred);
  }
  for (auto& [conn, part] : parts) post_recv(*conn, std::move(part));
}

void TcpTransport::post_send(Connection& c, Part part) {
  std::exception_ptr broke;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.dead) {
      part.request->fail(c.dead);
      return;
    }
    c.sendq.push_back(std::move(part));
    // Write on the caller's thread while the socket takes it; the I/O
    // thread finishes what does not fit.
    if (c.sendq.size() == 1 && !flush(c)) watch_out(c, true);
    if (c.dead && kill(c, c.dead)) broke = c.dead;
  }
  if (broke) fail(broke);
}

void TcpTransport::post_recv(Connection& c, Part part) {
  std::lock_guard<std::mutex> lock(c.mutex);
  for (auto it = c.held.begin(); it != c.held.end(); ++it) {
    if (it->tag != part.tag || it->waiter) continue;
    if (it->total != part.total) {
      part.request->fail(std::make_exception_ptr(CollectiveMismatch(detail::cat(
          "tcp: ", c.name, " sent ", it->total, " bytes where this rank expected ", part.total,
          " (the ranks called collectives or send/recv of different sizes)"))));
      return;
    }
    if (!it->complete) {
      it->waiter = std::move(part);
      return;
    }
    if (part.bytes) std::memcpy(part.data, it->data.get(), part.bytes);
    c.held.erase(it);
    part.request->part_done();
    return;
  }
  if (c.dead) {
    part.request->fail(c.dead);
    return;
  }
  c.recvq.push_back(std::move(part));
}

// ---- the I/O threads ------------------------------------------------------

void TcpTransport::watch_out(Connection& c, bool on) {
  if (c.watching_out == on || c.dead) return;
  c.watching_out = on;
  epoll_event ev{};
  ev.events = EPOLLIN | (on ? EPOLLOUT : 0u);
  ev.data.ptr = &c;
  epoll_ctl(c.epoll_fd, EPOLL_CTL_MOD, c.fd.get(), &ev);
}

void TcpTransport::serve(int stream) {
  epoll_event events[64];
  for (;;) {
    const int n = epoll_wait(epoll_fds_[stream], events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      log_warning(detail::cat("tcp: epoll_wait failed: ", strerror(errno)));
      return;
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.ptr == nullptr) return;  // the transport is closing
      on_event(*static_cast<Connection*>(events[i].data.ptr), events[i].events);
    }
  }
}

void TcpTransport::on_event(Connection& c, uint32_t events) {
  std::exception_ptr broke;
  bool deferred = false;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.dead) return;
    bool ok = true;
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) ok = receive(c);
    if (ok && (events & EPOLLOUT) && flush(c)) watch_out(c, false);
    if (c.dead && kill(c, c.dead)) broke = c.dead;
    deferred = !c.deferred.empty();
  }
  if (deferred) post_deferred(c);
  if (broke) fail(broke);
}

bool TcpTransport::flush(Connection& c) {
  while (!c.sendq.empty()) {
    Part& p = c.sendq.front();
    if (c.send_header_done == 0 && p.done == 0)
      c.send_header = FrameHeader{kFrameMagic, 0, p.tag, p.total};
    iovec iov[2];
    int n = 0;
    if (c.send_header_done < sizeof(FrameHeader))
      iov[n++] = {reinterpret_cast<uint8_t*>(&c.send_header) + c.send_header_done,
                  sizeof(FrameHeader) - c.send_header_done};
    if (p.done < p.bytes) iov[n++] = {p.data + p.done, p.bytes - p.done};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    ssize_t sent = n ? ::sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT) : 0;
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      c.dead = std::make_exception_ptr(NetworkError(detail::cat(
          "tcp: sending to ", c.name, " failed: ", strerror(errno),
          " (the peer may have exited or been killed)")));
      return true;
    }
    const size_t header_left = sizeof(FrameHeader) - c.send_header_done;
    const size_t to_header = std::min<size_t>(static_cast<size_t>(sent), header_left);
    c.send_header_done += to_header;
    p.done += static_cast<size_t>(sent) - to_header;
    if (c.send_header_done == sizeof(FrameHeader) && p.done == p.bytes) {
      auto request = std::move(p.request);
      c.sendq.pop_front();
      c.send_header_done = 0;
      request->part_done();
    }
  }
  return true;
}

// Reads what the socket has (up to a budget, so one busy peer does not
// starve the others on this thread). False when the connection broke.
bool TcpTransport::receive(Connection& c) {
  size_t budget = 8u << 20;
  while (budget > 0) {
    uint8_t* dst;
    size_t want;
    if (!c.in_message) {
      dst = reinterpret_cast<uint8_t*>(&c.recv_header) + c.recv_header_done;
      want = sizeof(FrameHeader) - c.recv_header_done;
    } else if (c.current_held) {
      dst = c.current_held->data.get() + c.current_held->done;
      want = c.current_held->bytes - c.current_held->done;
    } else {
      dst = c.current.data + c.current.done;
      want = c.current.bytes - c.current.done;
    }
    ssize_t got = want ? ::recv(c.fd.get(), dst, std::min(want, budget), MSG_DONTWAIT) : 0;
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (want && got <= 0) {
      c.dead = std::make_exception_ptr(NetworkError(detail::cat(
          "tcp: ", c.name, got == 0 ? " closed the connection" : " connection failed: ",
          got == 0 ? "" : strerror(errno), " (the peer may have exited or been killed)")));
      return false;
    }
    budget -= static_cast<size_t>(std::max<ssize_t>(got, 0));
    if (!c.in_message) {
      c.recv_header_done += static_cast<size_t>(got);
      if (c.recv_header_done == sizeof(FrameHeader)) start_message(c);
      if (c.dead) return false;
    } else {
      (c.current_held ? c.current_held->done : c.current.done) += static_cast<size_t>(got);
    }
    if (c.in_message) {
      const bool full = c.current_held ? c.current_held->done == c.current_held->bytes
                                       : c.current.done == c.current.bytes;
      if (full) finish_message(c);
    }
  }
  return true;
}

// A header is in: check it, then route the payload to its receive or hold it.
void TcpTransport::start_message(Connection& c) {
  const FrameHeader h = c.recv_header;
  c.recv_header_done = 0;
  const auto range = part_range(h.total, options_.streams, c.stream);
  if (h.magic != kFrameMagic || h.reserved != 0 || !range.present || h.total > (uint64_t{1} << 42)) {
    c.dead = std::make_exception_ptr(NetworkError(detail::cat(
        "tcp: ", c.name, " sent bytes that are not a dtrain frame (magic ", h.magic, ", ",
        h.total, " bytes); closing the group")));
    return;
  }
  c.in_message = true;
  for (auto it = c.recvq.begin(); it != c.recvq.end(); ++it) {
    if (it->tag != h.tag) continue;
    if (it->total != h.total) {
      c.dead = std::make_exception_ptr(CollectiveMismatch(detail::cat(
          "tcp: ", c.name, " sent ", h.total, " bytes where this rank expected ", it->total,
          " (the ranks called collectives or send/recv of different sizes)")));
      c.in_message = false;
      return;
    }
    c.current = std::move(*it);
    c.recvq.erase(it);
    return;
  }
  if (auto part = match_any(c, h.tag)) {
    if (part->total != h.total) {
      c.dead = std::make_exception_ptr(CollectiveMismatch(detail::cat(
          "tcp: ", c.name, " sent ", h.total, " bytes where this rank expected ", part->total,
          " (the ranks called collectives or send/recv of different sizes)")));
      part->request->fail(c.dead);
      c.in_message = false;
      return;
    }
    c.current = std::move(*part);
    return;
  }
  Held held;
  held.tag = h.tag;
  held.total = h.total;
  held.data.reset(new uint8_t[std::max<size_t>(range.bytes, 1)]);
  held.bytes = range.bytes;
  c.held.push_back(std::move(held));
  c.current_held = &c.held.back();
}

void TcpTransport::finish_message(Connection& c) {
  c.in_message = false;
  if (!c.current_held) {
    auto request = std::move(c.current.request);
    c.current = Part{};
    request->part_done();
    return;
  }
  Held& h = *c.current_held;
  c.current_held = nullptr;
  h.complete = true;
  if (!h.waiter) return;
  if (h.waiter->bytes) std::memcpy(h.waiter->data, h.data.get(), h.waiter->bytes);
  auto request = std::move(h.waiter->request);
  for (auto it = c.held.begin(); it != c.held.end(); ++it)
    if (&*it == &h) {
      c.held.erase(it);
      break;
    }
  request->part_done();
}

}  // namespace dtrain::transport::tcp

namespace dtrain::transport {

std::unique_ptr<Transport> connect_tcp(Store& store, int rank, int size,
                                       const TcpOptions& options) {
  return std::make_unique<tcp::TcpTransport>(tcp::connect_mesh(store, rank, size, options), rank,
                                             size, options);
}

}  // namespace dtrain::transport
