// The transport engine: requests, setup and teardown, posting (see
// engine.h for the design, engine_io.cpp for the I/O threads and the wire
// protocol).

#include "transport/engine/engine.h"

#include <atomic>
#include <chrono>
#include <optional>
#include <cerrno>
#include <algorithm>
#include <cstring>
#include <thread>

#include "common/enforce.h"
#include "common/logging.h"

namespace dtrain::transport::engine {

PartRange part_range(size_t total, int streams, int s) {
  if (streams == 1 || total < kSplitBytes) return s == 0 ? PartRange{0, total, true}
                                                         : PartRange{0, 0, false};
  auto cut = [&](int i) -> size_t {
    if (i == streams) return total;
    return (total / streams * i) & ~size_t{63};  // cache-line aligned cuts
  };
  return {cut(s), cut(s + 1) - cut(s), true};
}

// ---- requests -------------------------------------------------------------

uint64_t eager_grant(size_t unexpected_bytes, size_t connections) {
  const uint64_t share = std::max<uint64_t>(unexpected_bytes / std::max<size_t>(connections, 1),
                                            kMinEagerBytes);
  return std::min<uint64_t>(share, uint64_t{UINT32_MAX} << 10) & ~uint64_t{1023};
}


void EngineRequest::part_done() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (--remaining_ != 0) return;
  cv_.notify_all();
  finished(lock);
}

void EngineRequest::fail(std::exception_ptr error) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (error_) return;
  error_ = std::move(error);
  cv_.notify_all();
  if (remaining_ != 0) finished(lock);
}

void EngineRequest::finished(std::unique_lock<std::mutex>& lock) {
  auto fn = std::move(on_done_);
  on_done_ = nullptr;
  lock.unlock();
  if (fn) fn();
}

void EngineRequest::on_done(std::function<void()> fn) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (remaining_ != 0 && error_ == nullptr) {
    on_done_ = std::move(fn);
    return;
  }
  lock.unlock();
  fn();
}

void EngineRequest::wait(Clock::time_point deadline, const std::string& what) {
  if (poll_ != nullptr && !done() && transport_.poll(*this, *poll_, deadline) && !failed())
    return;
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

Engine::Engine(Links links, int rank, int size, const EngineOptions& options)
    : rank_(rank), size_(size), options_(options),
      pollers_(std::move(links.pollers)),
      spin_ns_(std::chrono::nanoseconds(4 * kMinPollSpin).count()) {
  conns_.resize(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const int streams = static_cast<int>(links.links[p].size());
    DTRAIN_ENFORCE(streams >= 1);
    for (int s = 0; s < streams; ++s) {
      const size_t poller = links.poller_of.empty() ? s : links.poller_of[p][s];
      DTRAIN_ENFORCE(poller < pollers_.size());
      auto c = std::make_unique<Connection>();
      c->link = std::move(links.links[p][s]);
      c->peer = p;
      c->stream = s;
      c->poller = pollers_[poller].get();
      c->name = links.peer_names[p];
      c->label = links.labels.empty() ? options.label : links.labels[p];
      c->credit = c->credit_limit = links.grants[p][s];
      c->eager_limit = links.granted;
      c->poller->add(*c->link, c.get());
      c->polled = true;
      conns_[p].push_back(std::move(c));
    }
  }
  for (size_t i = 0; i < pollers_.size(); ++i) threads_.emplace_back([this, i] { serve(int(i)); });
}

Engine::~Engine() {
  close(std::make_exception_ptr(
      NetworkError(detail::cat(options_.label, ": group '", options_.name, "' was destroyed"))));
}

void Engine::stop_threads() {
  for (auto& p : pollers_) p->stop();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
}

void Engine::close(std::exception_ptr error) {
  stop_threads();
  // With operations pending, the peers must hear of the failure at once.
  if (!this->error() && !pending()) close_in_order();
  fail(error);
}

void Engine::fail(std::exception_ptr error) {
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
      if (!timeout) c->link->abort();
    }
  }
}

bool Engine::pending() {
  {
    std::lock_guard<std::mutex> lock(any_mutex_);
    if (!any_.empty()) return true;
  }
  for (auto& peer : conns_)
    for (auto& c : peer) {
      std::lock_guard<std::mutex> lock(c->mutex);
      if (c->dead) continue;
      if (!c->sendq.empty() || !c->recvq.empty() || !c->awaiting_cts.empty() ||
          !c->awaiting_data.empty() || (c->in_message && c->current.request))
        return true;
      for (const auto& h : c->held)
        if (h.waiter) return true;
    }
  return false;
}

// A send completes once the kernel holds its bytes, not once the peer has
// them. Closing a socket with bytes from the peer unread in it (a credit
// frame, say), or receiving any after the close, makes the kernel reset the
// connection and drop what the peer's kernel has not acknowledged yet. So
// each live link ends its output (a FIN after the last byte) and the link
// stays open, whatever the peer still sends read and dropped, until the
// peer's kernel has acknowledged everything (Link::delivered: at once for
// rings, and for a peer that is alive, even if stopped) or the peer ended
// its output too; at most kCloseWait for a peer that does neither. The I/O
// threads are stopped: this thread reads, looking every millisecond.
void Engine::close_in_order() {
  constexpr auto kCloseWait = std::chrono::seconds(2);
  std::vector<Link*> open;
  for (auto& peer : conns_)
    for (auto& c : peer) {
      if (c->dead) continue;
      c->link->end_output();
      open.push_back(c->link.get());
    }
  const auto deadline = Clock::now() + std::min<Clock::duration>(options_.timeout, kCloseWait);
  std::vector<uint8_t> sink(64 << 10);
  for (;;) {
    for (auto it = open.begin(); it != open.end();) {
      ssize_t got;
      do got = (*it)->read(sink.data(), sink.size());
      while (got > 0 || (got < 0 && errno == EINTR));
      // The peer's FIN (0), or it is gone; or nothing more for now.
      const bool ended = !(got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
      it = ended || (*it)->delivered() ? open.erase(it) : std::next(it);
    }
    if (open.empty() || Clock::now() >= deadline) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool Engine::kill(Connection& c, std::exception_ptr error) {
  if (!c.dead) c.dead = error;
  // However it died (here, or on the I/O path that set `dead` first), its
  // link leaves the poller: a dead socket or ring reads as ready for ever,
  // and left in the set it would wake the I/O thread at every wait.
  if (c.polled) {
    c.polled = false;
    c.poller->remove(*c.link);
  }
  bool pending = false;
  auto fail_part = [&](Part& p) {
    if (p.request) p.request->fail(error);
    pending = true;
  };
  for (auto& p : c.sendq) fail_part(p);
  for (auto& p : c.recvq) fail_part(p);
  for (auto& [id, p] : c.awaiting_cts) fail_part(p);
  for (auto& [id, p] : c.awaiting_data) fail_part(p);
  if (c.in_message && c.current.request) fail_part(c.current);
  for (auto& h : c.held)
    if (h.waiter) fail_part(*h.waiter);
  c.sendq.clear();
  c.recvq.clear();
  c.awaiting_cts.clear();
  c.awaiting_data.clear();
  c.controlq.clear();
  c.writing = Connection::Writing::kNothing;
  c.current = Part{};
  c.current_held = nullptr;
  c.in_message = false;
  // Complete held messages stay: a receive may still claim them.
  for (auto it = c.held.begin(); it != c.held.end();)
    it = it->complete ? std::next(it) : c.held.erase(it);
  announced_ -= c.announced;
  c.announced = 0;
  return pending;
}

// ---- posting --------------------------------------------------------------

void Engine::check_peer(int peer, const char* op) const {
  DTRAIN_CHECK_ARG(peer >= 0 && peer < size_ && peer != rank_, options_.label, ": ", op,
                   " with peer ", peer, " on rank ", rank_, " of ", size_);
}

Engine::Parts Engine::split(int peer, uint64_t tag, uint8_t* data, size_t bytes,
                                        const std::shared_ptr<EngineRequest>& request,
                                        const char* op) {
  Parts parts;
  for (int s = 0; s < streams_of(peer); ++s) {
    const auto range = part_range(bytes, streams_of(peer), s);
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

RequestPtr Engine::isend(int peer, uint64_t tag, const void* data, size_t bytes) {
  if (auto e = error()) std::rethrow_exception(e);
  check_peer(peer, "isend");
  auto request = std::make_shared<EngineRequest>(*this, peer, parts_for(peer, bytes));
  if (parts_for(peer, bytes) == 1) request->poll_on(conns_[peer][0].get());
  for (auto& [c, part] : split(peer, tag, static_cast<uint8_t*>(const_cast<void*>(data)), bytes,
                               request, "isend"))
    post_send(*c, std::move(part));
  return request;
}

RequestPtr Engine::irecv(int peer, uint64_t tag, void* data, size_t bytes) {
  if (auto e = error()) std::rethrow_exception(e);
  check_peer(peer, "irecv");
  auto request = std::make_shared<EngineRequest>(*this, peer, parts_for(peer, bytes));
  if (parts_for(peer, bytes) == 1) request->poll_on(conns_[peer][0].get());
  for (auto& [c, part] : split(peer, tag, static_cast<uint8_t*>(data), bytes, request, "irecv"))
    post_recv(*c, std::move(part));
  return request;
}

RequestPtr Engine::irecv_any(uint64_t tag, void* data, size_t bytes) {
  if (auto e = error()) std::rethrow_exception(e);
  DTRAIN_CHECK_ARG(size_ > 1, options_.label, ": a receive from any rank in a group of one rank");
  // Its parts are counted once it is bound to a peer (EngineRequest::bind).
  auto request = std::make_shared<EngineRequest>(*this, -1, 1);
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
    request->bind(p, parts_for(p, mine->bytes));
    for (auto& [conn, part] : split(p, tag, mine->data, mine->bytes, request, "irecv"))
      post_recv(*conn, std::move(part));
    break;
  }
  if (auto e = error()) {  // failed meanwhile: fail() may have missed it
    if (take_any(request)) request->fail(e);
  }
  return request;
}

std::optional<AnyReceive> Engine::take_any(const std::shared_ptr<EngineRequest>& request) {
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

std::optional<Part> Engine::match_any(Connection& c, uint64_t tag) {
  if (c.stream != 0 || any_count_.load() == 0) return std::nullopt;
  // An earlier message of this tag from this peer that nobody has claimed
  // yet comes first: this one is held behind it, and irecv_any's scan binds
  // the receive to that one (it was held before the receive was posted).
  // Matching the arriving message here would take one peer's messages out
  // of order.
  if (std::any_of(c.held.begin(), c.held.end(),
                  [&](const Held& h) { return h.tag == tag && !h.waiter; }))
    return std::nullopt;
  AnyReceive a;
  {
    std::lock_guard<std::mutex> lock(any_mutex_);
    auto it = std::find_if(any_.begin(), any_.end(), [&](const AnyReceive& r) { return r.tag == tag; });
    if (it == any_.end()) return std::nullopt;
    a = std::move(*it);
    any_.erase(it);
    --any_count_;
  }
  a.request->bind(c.peer, parts_for(c.peer, a.bytes));
  std::optional<Part> mine;
  for (auto& [conn, part] : split(c.peer, tag, a.data, a.bytes, a.request, "irecv")) {
    if (conn == &c) mine = std::move(part);
    else c.deferred.emplace_back(conn, std::move(part));
  }
  return mine;
}

void Engine::post_deferred(Connection& c) {
  std::vector<std::pair<Connection*, Part>> parts;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    parts.swap(c.deferred);
  }
  // A part whose request failed meanwhile (this connection broke in the
  // read that matched it) is dropped: posting it would copy a held
  // payload into the buffer of a request that has already failed.
  for (auto& [conn, part] : parts)
    if (!part.request->failed()) post_recv(*conn, std::move(part));
}

// A part that fits the peer's eager credit goes at once; a larger one is
// announced (kRts) at once and waits in awaiting_cts for the peer's kCts.
// Either way the frame keeps its place in the send queue, so that messages
// of one tag are matched in the order they were posted, and no message
// waits for an earlier one's receive.
void Engine::post_send(Connection& c, Part part) {
  std::exception_ptr broke;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.dead) {
      part.request->fail(c.dead);
      return;
    }
    queue_part(c, std::move(part));
    // Written on the caller's thread while the socket takes it; the I/O
    // thread finishes what does not fit.
    pump(c);
    if (c.dead && kill(c, c.dead)) broke = c.dead;
  }
  if (broke) fail(broke);
}

void Engine::queue_part(Connection& c, Part part) {
  if (part.bytes + kHeldEntryCharge <= c.credit) {
    c.credit -= part.bytes + kHeldEntryCharge;
    part.kind = kData;
    c.sendq.push_back(std::move(part));
    return;
  }
  const uint64_t id = c.rts_sent++;
  Part rts;
  rts.kind = kRts;
  rts.tag = part.tag;
  rts.total = part.total;
  rts.rendezvous = id;
  part.kind = kRndvData;
  part.rendezvous = id;
  c.awaiting_cts.emplace(id, std::move(part));
  c.sendq.push_back(std::move(rts));
}

void Engine::post_recv(Connection& c, Part part) {
  std::exception_ptr broke;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    match_recv(c, std::move(part));
    if (c.dead && kill(c, c.dead)) broke = c.dead;
  }
  if (broke) fail(broke);
}

void Engine::match_recv(Connection& c, Part part) {
  for (auto it = c.held.begin(); it != c.held.end(); ++it) {
    if (it->tag != part.tag || it->waiter) continue;
    if (it->total != part.total) {
      part.request->fail(
          std::make_exception_ptr(CollectiveMismatch(mismatch_text(c, it->total, part.total))));
      return;
    }
    if (it->rendezvous) {
      const uint64_t id = it->id;
      c.held.erase(it);
      forget_announcement(c);
      answer_rts(c, id, std::move(part));
      pump(c);
      return;
    }
    if (!it->complete) {
      it->waiter = std::move(part);
      return;
    }
    if (part.bytes) std::memcpy(part.data, it->data.get(), part.bytes);
    const uint64_t bytes = it->bytes;
    c.held.erase(it);
    give_back(c, bytes + kHeldEntryCharge);
    pump(c);
    part.request->part_done();
    return;
  }
  if (c.dead) {
    part.request->fail(c.dead);
    return;
  }
  c.recvq.push_back(std::move(part));
}

}  // namespace dtrain::transport::engine
