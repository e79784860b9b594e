#pragma once

// The transport engine: the one implementation of the transport contract
// (transport/transport.h) over any carrier of bytes (transport/link.h): TCP
// sockets between hosts (tcp/), shared-memory rings inside one (shm/), or
// both in one group (transport/fabric.h).
//
// Each link carries frames of a fixed header (magic, tag, total bytes) and
// the payload (connection.h). A pair of ranks may be joined by several
// links (streams): a message of at least kSplitBytes is cut into one part
// per link, so that the copies of one large message run on several sockets
// and threads at once; smaller ones travel whole on the first. One I/O
// thread per poller serves its links: it reads each payload straight into
// the posted receive buffer, or, when the receive is not posted yet, into a
// held buffer that the receive later copies from. Held buffers are bounded
// by flow control: each link's receiver grants its sender eager credit; a
// part that does not fit is announced at once and sent only once its
// receive is posted; announcements are bounded by count. Sends are written
// on the caller's thread while the link takes them and finished by the I/O
// thread, or by a waiter that polls its link. Each request completes on its
// own; the first failure breaks the whole transport.
//
// Posting and teardown in engine.cpp, the I/O threads and the wire protocol
// in engine_io.cpp. Private to src/transport/.

#include <atomic>
#include <chrono>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtrain/errors.h"
#include "transport/engine/connection.h"
#include "transport/link.h"
#include "transport/tcp/options.h"
#include "transport/transport.h"

namespace dtrain::transport {

// The least eager credit a link grants, whatever the group's size.
constexpr size_t kMinEagerBytes = 4096;

// Messages at least this long are split over every link to their peer.
constexpr size_t kSplitBytes = 256 * 1024;

}  // namespace dtrain::transport

namespace dtrain::transport::engine {

// A link's reads of headers and small payloads go through a stage of
// kStageBytes; the rest of a payload of at least kDirectBytes is read
// straight into its destination.
constexpr size_t kStageBytes = 64 * 1024;
constexpr size_t kDirectBytes = 16 * 1024;

// How long a waiter serves its link itself before it sleeps (Engine::poll):
// between these, or not at all, adapting to how often polling pays.
constexpr std::chrono::microseconds kMinPollSpin{5};
constexpr std::chrono::microseconds kMaxPollSpin{160};
// While polling does not pay, one wait in this many still polls (for half
// of kMaxPollSpin), to find out whether it pays again.
constexpr uint32_t kPollProbeEvery = 32;

struct EngineOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // bounds a close
  std::string name;          // the group's name, for messages
  std::string label = "tcp";  // the first word of its messages (Links::labels per peer)
  // Announced messages this rank holds unmatched, all links together (each
  // entry costs about kHeldEntryCharge bytes); a peer that announces more
  // fails the group naming this cap (DTRAIN_TCP_UNEXPECTED_MESSAGES).
  size_t max_announced = TcpOptions().unexpected_messages;
};

// The eager credit each of a rank's `connections` grants its sender:
// unexpected_bytes shared over them, at least kMinEagerBytes, in whole KiB
// (the TCP hello carries KiB).
uint64_t eager_grant(size_t unexpected_bytes, size_t connections);

// What the transport runs over: links to each peer (one per stream; peers
// may have different counts, as rings and sockets in one group do), the
// eager credit each link's peer granted and the credit this rank granted
// each link, the peers' names, and the pollers whose threads serve them.
struct Links {
  std::vector<std::vector<std::unique_ptr<Link>>> links;  // [peer][stream]; none to itself
  std::vector<std::vector<uint64_t>> grants;              // [peer][stream], bytes
  uint64_t granted = 0;                                   // bytes, each link
  std::vector<std::string> peer_names;                    // "rank 3 (10.0.0.2:41234)"
  std::vector<std::unique_ptr<Poller>> pollers;           // one I/O thread each
  // [peer][stream]: the index of the poller serving that link; empty:
  // stream s is served by pollers[s].
  std::vector<std::vector<int>> poller_of;
  // [peer]: the first word of that link's messages; empty: options.label.
  std::vector<std::string> labels;
};

class Engine final : public Transport {
 public:
  Engine(Links links, int rank, int size, const EngineOptions& options);
  ~Engine() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override;
  RequestPtr irecv_any(uint64_t tag, void* data, size_t bytes) override;
  void fail(std::exception_ptr error) override;
  void close(std::exception_ptr error) override;
  std::exception_ptr error() const override {
    std::lock_guard<std::mutex> lock(error_mutex_);
    return error_;
  }
  // EngineRequest::wait's first phase: serves `c` (input and output) on the
  // calling thread, with its I/O thread's watch of the input muted, until
  // `request` is done, the spin budget has passed or `deadline` has; true
  // when the request is done. Waking the I/O thread and then the waiter
  // costs two context switches per message, where a small message takes a
  // few microseconds to cross; MPI's progress engine polls in the caller
  // the same way. The budget adapts: a poll that ends in time keeps it, or
  // raises it to twice what it took (up to kMaxPollSpin); one that runs out
  // halves it, down to none below kMinPollSpin, so that a rank whose peers
  // need the CPU it would spin on (more ranks than cores) leaves it to them
  // and sleeps at once, probing now and then (after a long wait for a busy
  // peer too, polling comes back at the first probe that pays).
  bool poll(EngineRequest& request, Connection& c, Clock::time_point deadline);
  const std::string& peer_name(int peer) const {
    static const std::string any = "any rank";
    return peer < 0 ? any : conns_[peer][0]->name;
  }

 private:
  using Parts = std::vector<std::pair<Connection*, Part>>;
  int streams_of(int peer) const { return static_cast<int>(conns_[peer].size()); }
  // How many parts (streams) a message of `bytes` to or from `peer` takes.
  int parts_for(int peer, size_t bytes) const {
    return bytes >= kSplitBytes ? streams_of(peer) : 1;
  }
  // Throws InvalidArgument unless `peer` is another rank of the group.
  void check_peer(int peer, const char* op) const;
  Parts split(int peer, uint64_t tag, uint8_t* data, size_t bytes,
              const std::shared_ptr<EngineRequest>& request, const char* op);
  void post_send(Connection& c, Part part);
  // Queues `part` as kData if its payload and entry fit the credit, else
  // announces it (kRts), which costs no credit.
  void queue_part(Connection& c, Part part);
  void post_recv(Connection& c, Part part);
  // post_recv's work under c.mutex.
  void match_recv(Connection& c, Part part);
  // Removes `request` from the unmatched irecv_any list; false when it was
  // matched (or failed) meanwhile. Takes any_mutex_.
  std::optional<AnyReceive> take_any(const std::shared_ptr<EngineRequest>& request);
  // On `c` (stream 0, its mutex held): the first unmatched irecv_any for
  // `tag`, bound to c's peer; its part for `c` is returned, the others go
  // to c.deferred. nullopt when there is none.
  std::optional<Part> match_any(Connection& c, uint64_t tag);
  void post_deferred(Connection& c);

  // ---- engine_io.cpp: everything below runs with c.mutex held.
  void serve(int poller);
  void on_event(Connection& c, uint32_t events);
  // on_event's work with `lock` (of c.mutex) held; releases it.
  void handle(Connection& c, uint32_t events, std::unique_lock<std::mutex>& lock);
  // Whether c's I/O thread watches its input (not while a waiter polls).
  void mute_input(Connection& c, bool muted);
  // Writes what the socket takes; asks for EPOLLOUT while output is left.
  void pump(Connection& c);
  bool flush(Connection& c);            // true when nothing is left to write
  bool receive(Connection& c);          // false when the connection broke
  void consume_staged(Connection& c);
  // The rest of the payload being read (its bytes in *left), and the step
  // past `n` more of them (finishing the message once it is whole).
  uint8_t* payload_at(Connection& c, size_t* left);
  void advance_payload(Connection& c, size_t n);
  void start_message(Connection& c);
  // The posted receive a kData or kRts header matches: the first for its
  // tag from this peer, else an irecv_any. nullopt when there is none, or
  // when the sizes differ (c.dead is then set and the receive failed).
  std::optional<Part> claim_receive(Connection& c, const FrameHeader& h);
  void start_payload(Connection& c, const FrameHeader& h);
  void start_rendezvous(Connection& c, const FrameHeader& h);
  // A held announcement leaves c.held (matched, or its connection died).
  void forget_announcement(Connection& c);
  void on_control(Connection& c, const FrameHeader& h);
  bool charge(Connection& c, uint64_t cost);
  void finish_message(Connection& c);
  // The receive `part` matched the peer's kRts `id`: ask for the payload.
  void answer_rts(Connection& c, uint64_t id, Part part);
  // `bytes` of eager payload reached their receive: credit owed back.
  void give_back(Connection& c, uint64_t bytes);
  void watch_out(Connection& c, bool on);
  // True when a request is still queued or awaited on a live connection.
  bool pending();
  // Stops the I/O threads (idempotent); nothing moves afterwards.
  void stop_threads();
  // Closes the live connections without a reset; see transport.cpp.
  void close_in_order();
  // Marks the connection dead and fails what is queued on it; returns true
  // when something was pending (the transport must then fail too).
  bool kill(Connection& c, std::exception_ptr error);
  // A NetworkError (or `Error`) for what the peer sent; kills nothing.
  template <typename Error = NetworkError, typename... Args>
  void protocol_error(Connection& c, const Args&... what);

  const int rank_, size_;
  const EngineOptions options_;
  std::vector<std::vector<std::unique_ptr<Connection>>> conns_;  // [peer][stream]
  std::vector<std::unique_ptr<Poller>> pollers_;  // one I/O thread each
  std::vector<std::thread> threads_;
  mutable std::mutex error_mutex_;
  std::exception_ptr error_;
  // Unmatched irecv_any requests, in posting order. Lock order: a
  // connection's mutex, then any_mutex_.
  std::mutex any_mutex_;
  std::list<AnyReceive> any_;
  std::atomic<size_t> any_count_{0};
  // Announcements held unmatched on every link (Connection::announced).
  std::atomic<size_t> announced_{0};
  // How long a waiter polls before it sleeps (poll adapts it; 0: not at
  // all), and the waits that did not poll since the last probe.
  std::atomic<int64_t> spin_ns_;
  std::atomic<uint32_t> unpolled_{0};
};

}  // namespace dtrain::transport::engine
