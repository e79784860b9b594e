// The transport engine's I/O threads and wire protocol: frames, eager credit
// and rendezvous (connection.h), read and written without blocking. Every
// function here runs with the connection's mutex held.

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "common/enforce.h"
#include "common/logging.h"
#include "transport/engine/engine.h"

namespace dtrain::transport::engine {
namespace {

// The largest message a header may declare (4 TiB): more is garbage.
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 42;

}  // namespace

std::string mismatch_text(const Connection& c, uint64_t sent, uint64_t expected) {
  return detail::cat(c.label, ": ", c.name, " sent ", sent, " bytes where this rank expected ",
                     expected, " (the ranks called collectives or send/recv of different sizes)");
}

namespace {

// The part of a kData or kRts frame's message on c's stream; false (the
// connection's error set) when the header declares a message this stream
// cannot carry.
bool part_of(Connection& c, const FrameHeader& h, int streams, PartRange* range) {
  *range = part_range(h.total, streams, c.stream);
  if (range->present && h.total <= kMaxMessageBytes) return true;
  c.dead = std::make_exception_ptr(NetworkError(detail::cat(
      c.label, ": ", c.name, h.kind == kRts ? " announced" : " sent", " a message of ", h.total,
      " bytes that this stream cannot carry; closing the group")));
  return false;
}

}  // namespace

template <typename Error, typename... Args>
void Engine::protocol_error(Connection& c, const Args&... what) {
  c.dead = std::make_exception_ptr(Error(detail::cat(c.label, ": ", c.name, " ", what...)));
}

void Engine::watch_out(Connection& c, bool on) {
  if (c.watching_out == on || c.dead) return;
  c.watching_out = on;
  c.poller->watch(*c.link, &c, !c.input_muted, on);
}

void Engine::mute_input(Connection& c, bool muted) {
  if (c.input_muted == muted || !c.polled) return;
  c.input_muted = muted;
  c.poller->watch(*c.link, &c, !muted, c.watching_out);
}

bool Engine::poll(EngineRequest& request, Connection& c, Clock::time_point deadline) {
  using std::chrono::nanoseconds;
  const int64_t min_spin = nanoseconds(kMinPollSpin).count();
  const int64_t max_spin = nanoseconds(kMaxPollSpin).count();
  const int64_t kept = spin_ns_.load(std::memory_order_relaxed);
  int64_t spin = kept;
  if (spin == 0) {  // polling has not paid lately: probe now and then
    if (unpolled_.fetch_add(1, std::memory_order_relaxed) % kPollProbeEvery != 0) return false;
    spin = max_spin / 2;
  }
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.dead) return request.done();
    if (c.waiters_polling++ == 0) mute_input(c, true);
  }
  const auto start = Clock::now();
  const auto until = std::min(deadline, start + nanoseconds(spin));
  bool done = false;
  for (unsigned i = 0;; ++i) {
    // Input, and output the link takes now (the rest of a send that did
    // not fit the socket's buffer, say), which the I/O thread would
    // otherwise write once the poller says there is room.
    std::unique_lock<std::mutex> lock(c.mutex, std::try_to_lock);
    if (lock) handle(c, Poller::kIn | Poller::kOut, lock);
    if ((done = request.done())) break;
    if ((i & 7) == 7 && Clock::now() >= until) break;
  }
  const int64_t took = nanoseconds(Clock::now() - start).count();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (--c.waiters_polling == 0) mute_input(c, false);
  }
  // A probe that pays sets the budget from what it took, not from its own
  // length: where the message was simply there already (a peer that ran
  // while this rank slept), polling has shown nothing.
  if (done)
    spin = std::clamp<int64_t>(std::max(kept, 2 * took), min_spin, max_spin);
  else
    spin = kept / 2 >= min_spin ? kept / 2 : 0;
  spin_ns_.store(spin, std::memory_order_relaxed);
  return done;
}

void Engine::serve(int poller) {
  std::vector<Poller::Ready> ready;
  while (pollers_[poller]->wait(ready))
    for (const auto& r : ready) on_event(*static_cast<Connection*>(r.key), r.events);
}

void Engine::on_event(Connection& c, uint32_t events) {
  std::unique_lock<std::mutex> lock(c.mutex);
  handle(c, events, lock);
}

void Engine::handle(Connection& c, uint32_t events, std::unique_lock<std::mutex>& lock) {
  if (c.dead) return;  // `lock` releases the mutex
  try {
    if (events & Poller::kIn) receive(c);
    // Output: what the link takes now, and control frames the input queued.
    if (!c.dead && ((events & Poller::kOut) || !c.watching_out)) {
      if (flush(c)) watch_out(c, false);
      else watch_out(c, true);
    }
  } catch (const std::bad_alloc&) {
    protocol_error(c, ": this rank ran out of memory receiving from it");
  } catch (const std::exception& e) {
    protocol_error(c, ": ", e.what());
  }
  std::exception_ptr broke;
  if (c.dead && kill(c, c.dead)) broke = c.dead;
  const bool deferred = !c.deferred.empty();
  lock.unlock();
  if (deferred) post_deferred(c);
  if (broke) fail(broke);
}

void Engine::pump(Connection& c) {
  if (c.watching_out || c.dead) return;  // the I/O thread writes once the socket takes more
  if (!flush(c)) watch_out(c, true);
}

bool Engine::flush(Connection& c) {
  using Writing = Connection::Writing;
  if (c.output_error != 0) {  // the peer stopped reading: only data for it matters
    c.controlq.clear();
    if (c.sendq.empty()) return true;
    c.dead = std::make_exception_ptr(NetworkError(detail::cat(
        c.label, ": sending to ", c.name, " failed: ", strerror(c.output_error),
        " (the peer may have exited or been killed)")));
    return true;
  }
  for (;;) {
    if (c.writing == Writing::kNothing) {
      if (!c.controlq.empty()) {
        c.send_header = c.controlq.front();
        c.controlq.pop_front();
        c.writing = Writing::kControl;
      } else if (!c.sendq.empty()) {
        const Part& p = c.sendq.front();
        c.send_header = FrameHeader{kFrameMagic, p.kind, p.kind == kRndvData ? p.rendezvous : p.tag,
                                    p.kind == kRndvData ? p.bytes : p.total};
        c.writing = Writing::kPart;
      } else {
        return true;
      }
      c.send_header_done = 0;
    }
    Part* p = c.writing == Writing::kPart ? &c.sendq.front() : nullptr;
    const size_t payload = p && p->kind != kRts ? p->bytes : 0;
    iovec iov[2];
    int n = 0;
    if (c.send_header_done < sizeof(FrameHeader))
      iov[n++] = {reinterpret_cast<uint8_t*>(&c.send_header) + c.send_header_done,
                  sizeof(FrameHeader) - c.send_header_done};
    if (p && p->done < payload) iov[n++] = {p->data + p->done, payload - p->done};
    const ssize_t sent = n ? c.link->write(iov, n) : 0;
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      // A credit or kCts frame the peer no longer reads: it closed after its
      // last send, whose bytes may still be on their way in. Keep reading
      // them; only a send of ours to it fails (above, on the next flush).
      if (!p && c.sendq.empty()) {
        c.output_error = errno;
        c.writing = Writing::kNothing;
        c.controlq.clear();
        return true;
      }
      c.dead = std::make_exception_ptr(NetworkError(detail::cat(
          c.label, ": sending to ", c.name, " failed: ", strerror(errno),
          " (the peer may have exited or been killed)")));
      return true;
    }
    const size_t header_left = sizeof(FrameHeader) - c.send_header_done;
    const size_t to_header = std::min<size_t>(static_cast<size_t>(sent), header_left);
    c.send_header_done += to_header;
    if (p) p->done += static_cast<size_t>(sent) - to_header;
    if (c.send_header_done < sizeof(FrameHeader) || (p && p->done < payload)) continue;
    c.writing = Writing::kNothing;
    if (!p) continue;
    auto request = std::move(p->request);  // none for a kRts
    c.sendq.pop_front();
    if (request) request->part_done();
  }
}

// Where the rest of the message being read goes: its posted receive or
// its held buffer.
uint8_t* Engine::payload_at(Connection& c, size_t* left) {
  if (c.current_held) {
    *left = c.current_held->bytes - c.current_held->done;
    return c.current_held->data.get() + c.current_held->done;
  }
  *left = c.current.bytes - c.current.done;
  return c.current.data + c.current.done;
}

void Engine::advance_payload(Connection& c, size_t n) {
  (c.current_held ? c.current_held->done : c.current.done) += n;
  size_t left;
  payload_at(c, &left);
  if (left == 0) finish_message(c);
}

// Takes frames out of the stage: headers, and payload bytes copied to
// where they go.
void Engine::consume_staged(Connection& c) {
  while (c.staged_begin < c.staged_end && !c.dead) {
    const size_t avail = c.staged_end - c.staged_begin;
    const uint8_t* src = c.stage.get() + c.staged_begin;
    if (!c.in_message) {
      const size_t n = std::min(avail, sizeof(FrameHeader) - c.recv_header_done);
      std::memcpy(reinterpret_cast<uint8_t*>(&c.recv_header) + c.recv_header_done, src, n);
      c.staged_begin += n;
      c.recv_header_done += n;
      if (c.recv_header_done < sizeof(FrameHeader)) continue;
      start_message(c);
      if (c.in_message) advance_payload(c, 0);  // an empty payload ends at once
      continue;
    }
    size_t left;
    uint8_t* dst = payload_at(c, &left);
    const size_t n = std::min(avail, left);
    std::memcpy(dst, src, n);
    c.staged_begin += n;
    advance_payload(c, n);
  }
}

// Reads what the link has, up to a budget (so one busy peer does not
// starve the others on this thread), until a read comes back short (the
// link is drained for now: a level-triggered poller calls again when more
// comes). Headers and small payloads are read into the connection's stage,
// with whatever follows them, so that a small message takes one read, not
// one for its header, one for its payload and one to find nothing more;
// the rest of a payload of at least kDirectBytes is read straight into its
// destination. False when the connection broke.
bool Engine::receive(Connection& c) {
  size_t budget = 8u << 20;
  while (budget > 0) {
    consume_staged(c);
    if (c.dead) return false;
    size_t left = 0;
    uint8_t* payload = c.in_message ? payload_at(c, &left) : nullptr;
    const bool direct = left >= kDirectBytes;
    if (!direct && !c.stage) c.stage.reset(new uint8_t[kStageBytes]);
    uint8_t* dst = direct ? payload : c.stage.get();
    const size_t want = std::min(direct ? left : kStageBytes, budget);
    const ssize_t got = c.link->read(dst, want);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (got <= 0) {
      // The peer closed in order (close_in_order): answer with our FIN,
      // which is what lets its close complete.
      if (got == 0) c.link->end_output();
      c.dead = std::make_exception_ptr(NetworkError(detail::cat(
          c.label, ": ", c.name, got == 0 ? " closed the connection" : " connection failed: ",
          got == 0 ? "" : strerror(errno), " (the peer may have exited or been killed)")));
      return false;
    }
    budget -= static_cast<size_t>(got);
    if (direct) {
      advance_payload(c, static_cast<size_t>(got));
    } else {
      c.staged_begin = 0;
      c.staged_end = static_cast<size_t>(got);
    }
    if (static_cast<size_t>(got) < want) {
      consume_staged(c);
      return !c.dead;
    }
  }
  consume_staged(c);
  return !c.dead;
}

// A header is in: check it and act on it. Only kData and kRndvData frames
// have a payload (c.in_message).
void Engine::start_message(Connection& c) {
  const FrameHeader h = c.recv_header;
  c.recv_header_done = 0;
  if (h.magic != kFrameMagic) {
    protocol_error(c, "sent bytes that are not a dtrain frame (magic ", h.magic,
                   "); closing the group");
    return;
  }
  switch (h.kind) {
    case kData:
      return start_payload(c, h);
    case kRts:
      return start_rendezvous(c, h);
    case kRndvData: {
      auto it = c.awaiting_data.find(h.tag);
      if (it == c.awaiting_data.end() || it->second.bytes != h.total) {
        protocol_error(c, "sent a payload this rank did not ask for (rendezvous ", h.tag, ", ",
                       h.total, " bytes); closing the group");
        return;
      }
      c.current = std::move(it->second);
      c.current.kind = kRndvData;
      c.awaiting_data.erase(it);
      c.in_message = true;
      return;
    }
    case kCts:
    case kCredit:
      return on_control(c, h);
    default:
      protocol_error(c, "sent a frame of unknown kind ", h.kind, "; closing the group");
  }
}

std::optional<Part> Engine::claim_receive(Connection& c, const FrameHeader& h) {
  std::optional<Part> part;
  auto it = std::find_if(c.recvq.begin(), c.recvq.end(),
                         [&](const Part& p) { return p.tag == h.tag; });
  if (it != c.recvq.end()) {
    part = std::move(*it);
    c.recvq.erase(it);
  } else {
    part = match_any(c, h.tag);
  }
  if (part && part->total != h.total) {
    c.dead = std::make_exception_ptr(CollectiveMismatch(mismatch_text(c, h.total, part->total)));
    part->request->fail(c.dead);
    return std::nullopt;
  }
  return part;
}

// An eager payload: into its posted receive, or held, within the credit
// this rank granted (a sender that overdraws it is refused, so what the
// network makes this rank allocate stays bounded).
void Engine::start_payload(Connection& c, const FrameHeader& h) {
  PartRange range;
  if (!part_of(c, h, streams_of(c.peer), &range)) return;
  if (!charge(c, range.bytes + kHeldEntryCharge)) return;
  if (auto part = claim_receive(c, h)) {
    c.current = std::move(*part);
    c.current.kind = kData;
    c.in_message = true;
    return;
  }
  if (c.dead) return;
  c.in_message = true;
  Held held;
  held.tag = h.tag;
  held.total = h.total;
  held.data.reset(new uint8_t[std::max<size_t>(range.bytes, 1)]);
  held.bytes = range.bytes;
  c.held.push_back(std::move(held));
  c.current_held = &c.held.back();
}

// A kRts: answered at once when its receive is posted, else held (no
// bytes) until it is, within the count of announcements this rank holds.
void Engine::start_rendezvous(Connection& c, const FrameHeader& h) {
  PartRange range;
  if (!part_of(c, h, streams_of(c.peer), &range)) return;
  const uint64_t id = c.rts_seen++;
  if (auto part = claim_receive(c, h)) return answer_rts(c, id, std::move(*part));
  if (c.dead) return;
  if (announced_.fetch_add(1) >= options_.max_announced) {
    announced_.fetch_sub(1);
    protocol_error(c, "announced more messages ahead of their receives than the ",
                   options_.max_announced, " this rank holds (all peers together; "
                   "DTRAIN_TCP_UNEXPECTED_MESSAGES); closing the group");
    return;
  }
  ++c.announced;
  Held held;
  held.tag = h.tag;
  held.total = h.total;
  held.bytes = range.bytes;
  held.rendezvous = true;
  held.id = id;
  c.held.push_back(std::move(held));
}

void Engine::forget_announcement(Connection& c) {
  --c.announced;
  announced_.fetch_sub(1);
}

// The credit a kData frame costs (connection.h): refused, and the group
// closed, when the sender overdraws what this rank granted.
bool Engine::charge(Connection& c, uint64_t cost) {
  if (c.eager_in + cost > c.eager_limit) {
    protocol_error(c, "sent messages costing ", c.eager_in + cost, " bytes ahead of its "
                   "receives, over the ", c.eager_limit, " bytes of credit this rank granted "
                   "(each message costs ", kHeldEntryCharge, " bytes besides its payload); "
                   "closing the group");
    return false;
  }
  c.eager_in += cost;
  return true;
}

void Engine::answer_rts(Connection& c, uint64_t id, Part part) {
  part.kind = kRndvData;
  c.awaiting_data.emplace(id, std::move(part));
  c.controlq.push_back(FrameHeader{kFrameMagic, kCts, id, 0});
}

void Engine::on_control(Connection& c, const FrameHeader& h) {
  if (h.kind == kCredit) {
    if (h.tag != 0 || h.total > c.credit_limit - c.credit) {
      protocol_error(c, "gave back ", h.total, " bytes of credit, more than it was lent; "
                     "closing the group");
      return;
    }
    c.credit += h.total;
    return;
  }
  auto it = c.awaiting_cts.find(h.tag);
  if (it == c.awaiting_cts.end() || h.total != 0) {
    protocol_error(c, "asked for a message this rank never announced (rendezvous ", h.tag,
                   "); closing the group");
    return;
  }
  c.sendq.push_back(std::move(it->second));
  c.awaiting_cts.erase(it);
}

void Engine::give_back(Connection& c, uint64_t bytes) {
  c.owed += bytes;
  // In batches (a quarter of the credit, 1 MiB at most), so that small
  // messages do not each cost a frame back, and a sender streaming large
  // ones rarely finds its credit short (which would cost it a round trip).
  if (c.owed < std::clamp<uint64_t>(c.eager_limit / 4, 1, uint64_t{1} << 20)) return;
  c.controlq.push_back(FrameHeader{kFrameMagic, kCredit, 0, c.owed});
  c.eager_in -= c.owed;
  c.owed = 0;
}

void Engine::finish_message(Connection& c) {
  c.in_message = false;
  if (!c.current_held) {
    auto request = std::move(c.current.request);
    if (c.current.kind == kData) give_back(c, c.current.bytes + kHeldEntryCharge);
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
  give_back(c, h.bytes + kHeldEntryCharge);
  for (auto it = c.held.begin(); it != c.held.end(); ++it)
    if (&*it == &h) {
      c.held.erase(it);
      break;
    }
  request->part_done();
}

}  // namespace dtrain::transport::engine
