#include "transport/tcp/mesh.h"

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "common/decimal.h"
#include "common/enforce.h"
#include "common/logging.h"
#include "transport/engine/engine.h"
#include "transport/tcp/hello.h"

namespace dtrain::transport::tcp {
namespace {

// The eager credit each connection of a full mesh of `size` ranks grants:
// options.unexpected_bytes over options.streams per peer.
uint64_t full_mesh_grant(const TcpOptions& options, int size) {
  return engine::eager_grant(options.unexpected_bytes,
                             static_cast<size_t>(std::max(size - 1, 1)) * options.streams);
}

uint64_t random_id() {
  uint64_t id = 0;
  while (getrandom(&id, sizeof(id), 0) != static_cast<ssize_t>(sizeof(id))) {
    if (errno != EINTR) throw NetworkError(detail::cat("getrandom() failed: ", strerror(errno)));
  }
  return id;
}

void set_nodelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

struct Endpoint {
  std::string host;
  uint16_t port = 0;
};

Endpoint parse_endpoint(const std::string& text, int peer) {
  const auto nl = text.find('\n');
  DTRAIN_CHECK_ARG(nl != std::string::npos, "tcp: the store holds a malformed address for rank ",
                   peer, ": '", text, "'");
  return {text.substr(0, nl), net::parse_port(text.substr(nl + 1), "tcp: port of rank " +
                                                                      std::to_string(peer))};
}

// The group's id, as rank 0 published it in the store.
uint64_t parse_group_id(const std::string& text) {
  const auto id = detail::parse_decimal_u64(text);
  DTRAIN_CHECK_ARG(id.has_value(), "tcp: the store holds a malformed group id: '", text, "'");
  return *id;
}

// Descriptors open in this process now.
size_t open_descriptors() {
  size_t n = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (readdir(dir) != nullptr) ++n;
    closedir(dir);
  }
  return n > 2 ? n - 2 : n;  // less "." and ".."
}

// Makes room for `needed` more descriptors: the soft RLIMIT_NOFILE is raised
// to the hard one (net::raise_open_file_limit), and if that is still too low
// the error names the limit and the count.
void ensure_descriptors(size_t needed, const TcpOptions& options, int size) {
  net::raise_open_file_limit();
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return;
  const size_t open = open_descriptors();
  if (open + needed <= lim.rlim_cur) return;
  throw NetworkError(detail::cat(
      "tcp: group '", options.name, "' of ", size, " ranks needs ", needed,
      " file descriptors (a connection per peer and stream, and a listener) and this process "
      "has ", open, " open under a limit of ", lim.rlim_cur,
      " (RLIMIT_NOFILE, raised to its hard limit already): raise it (ulimit -n, "
      "LimitNOFILE=, or /etc/security/limits.conf), or set DTRAIN_TCP_STREAMS=1"));
}

enum class Read { kMore, kDone, kClosed };

// Reads what has arrived of `want` bytes into `buf` (`got` so far), without
// blocking.
Read read_some(int fd, void* buf, size_t want, size_t& got) {
  auto* bytes = static_cast<uint8_t*>(buf);
  while (got < want) {
    const ssize_t n = ::recv(fd, bytes + got, want - got, MSG_DONTWAIT);
    if (n > 0) {
      got += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Read::kMore;
    return Read::kClosed;
  }
  return Read::kDone;
}

std::string peer_of(const sockaddr_storage& ss, socklen_t len) {
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  getnameinfo(reinterpret_cast<const sockaddr*>(&ss), len, host, sizeof(host), port,
              sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV);
  return net::endpoint(host, static_cast<uint16_t>(std::atoi(port)));
}

const char* refusal_text(uint32_t why) {
  switch (static_cast<Refusal>(why)) {
    case Refusal::kAnotherGroup:
      return "this rank's hello names another group (a rank of an earlier job or attempt?)";
    case Refusal::kOutOfRange:
      return "this rank's rank or stream is out of its range (is every rank started with the "
             "same world size and DTRAIN_TCP_STREAMS?)";
    case Refusal::kTokenOnJoinerOnly:
      return "this rank uses a job token and it has none (is DTRAIN_STORE_TOKEN set on every "
             "rank?)";
    case Refusal::kTokenOnAcceptorOnly:
      return "it uses a job token and this rank has none (is DTRAIN_STORE_TOKEN set on every "
             "rank?)";
  }
  return "it gave no reason this version knows";
}

// Connections that have not sent a whole hello yet, at most: a flood of
// silent strangers costs this many descriptors, and evicts only its own
// kind (a peer whose hello passed is never evicted; one evicted before its
// hello arrived connects again).
constexpr size_t kMaxSilent = 256;
constexpr size_t kAcceptBatch = 64;  // accepted per turn of the event loop

// An accepted connection on its way through the handshake: its hello,
// then (with a job token) its proof, each read without blocking.
struct Pending {
  net::Fd fd;
  std::string peer;
  Hello hello{};
  store_auth::Nonce nonce{};  // ours, sent in the reply
  store_auth::Proof proof{};  // the joiner's
  bool replied = false;
  size_t got = 0;             // bytes of the hello, then of the proof
};

// A connection this rank opened to a lower rank: its hello is sent, the
// answer (hello, and proof with a token) is read without blocking.
struct Join {
  int peer = 0, stream = 0;
  std::string host;
  uint16_t port = 0;
  net::Fd fd;
  store_auth::Nonce nonce{};
  uint8_t answer[sizeof(Hello) + sizeof(store_auth::Proof)] = {};
  size_t got = 0;
  bool done = false;
  int closed = 0;  // times the listener closed it before answering
};

class MeshBuilder {
 public:
  MeshBuilder(Store& store, int rank, int size, const TcpOptions& options, const MeshScope& scope)
      : store_(store), rank_(rank), size_(size), options_(options), scope_(scope),
        deadline_(Clock::now() + options.timeout),
        grant_(scope.grant ? scope.grant : full_mesh_grant(options, size)) {
    mesh_.conns.resize(size);
    mesh_.grants.resize(size);
    mesh_.peer_names.resize(size);
    for (int p = 0; p < size; ++p) {
      if (p == rank || !scope.wants(p)) continue;
      mesh_.conns[p].resize(options.streams);
      mesh_.grants[p].resize(options.streams);
    }
    const int lower = scope.lower < 0 ? rank : std::min(scope.lower, rank);
    for (int p = 0; p < lower; ++p)
      for (int s = 0; s < options.streams && scope.wants(p); ++s) {
        joins_.emplace_back();
        joins_.back().peer = p;
        joins_.back().stream = s;
      }
    for (int p = rank + 1; p < size && scope.higher; ++p)
      if (scope.wants(p)) missing_ += options.streams;
  }

  Mesh build() {
    ensure_descriptors(joins_.size() + missing_ + 1, options_, size_);
    publish();
    for (auto& j : joins_) open_join(j);
    run();
    return std::move(mesh_);
  }

 private:
  void publish() {
    const std::string host =
        options_.local_address.empty() ? "127.0.0.1" : options_.local_address;
    uint16_t port = 0;
    listener_ = net::listen_on(host, 0, &port);
    fcntl(listener_.get(), F_SETFL, fcntl(listener_.get(), F_GETFL) | O_NONBLOCK);
    if (rank_ == 0) {
      id_ = random_id();
      store_.set("tcp/id", std::to_string(id_));
    }
    store_.set("tcp/addr/" + std::to_string(rank_), host + "\n" + std::to_string(port));
    if (rank_ != 0) id_ = parse_group_id(store_.get_string("tcp/id"));
  }

  bool has_token() const { return !options_.token.empty(); }

  Hello hello(uint32_t stream, const store_auth::Nonce& nonce) const {
    return Hello{kHelloMagic, kHelloVersion, id_, static_cast<uint32_t>(rank_), stream,
                 has_token() ? kHelloHasToken : 0u, static_cast<uint32_t>(grant_ >> 10), nonce};
  }

  store_auth::Nonce fresh_nonce() const {
    return has_token() ? store_auth::random_nonce() : store_auth::Nonce{};
  }

  // ---- the event loop ----------------------------------------------------

  void run() {
    size_t joins_left = joins_.size();
    std::vector<Pending> pending;
    std::vector<pollfd> fds;
    std::vector<Join*> polled_joins;
    while (joins_left > 0 || missing_ > 0) {
      fds.clear();
      polled_joins.clear();
      fds.push_back({listener_.get(), static_cast<short>(missing_ > 0 ? POLLIN : 0), 0});
      for (auto& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
      for (auto& j : joins_) {
        if (j.done) continue;
        fds.push_back({j.fd.get(), POLLIN, 0});
        polled_joins.push_back(&j);
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
      if (left.count() <= 0) throw timeout_naming_missing();
      const int rc = ::poll(fds.data(), fds.size(),
                            static_cast<int>(std::min<int64_t>(left.count(), 1000)));
      if (rc < 0 && errno != EINTR)
        throw NetworkError(detail::cat("tcp: poll failed: ", strerror(errno)));
      if (rc <= 0) continue;
      for (size_t i = 0; i < polled_joins.size(); ++i) {
        if (fds[1 + pending.size() + i].revents == 0) continue;
        if (advance_join(*polled_joins[i])) --joins_left;
      }
      std::vector<Pending> kept;
      kept.reserve(pending.size() + kAcceptBatch);
      for (size_t i = 0; i < pending.size(); ++i) {
        const Step step = fds[1 + i].revents ? advance(pending[i]) : Step::kWaiting;
        if (step == Step::kWaiting) kept.push_back(std::move(pending[i]));
        if (step == Step::kAdopted) --missing_;
      }
      pending.swap(kept);
      if (fds[0].revents & POLLIN) accept_some(pending);
    }
  }

  // ---- joining lower ranks -------------------------------------------------

  void open_join(Join& j) {
    if (j.host.empty()) {
      const auto ep =
          parse_endpoint(store_.get_string("tcp/addr/" + std::to_string(j.peer)), j.peer);
      j.host = ep.host;
      j.port = ep.port;
      mesh_.peer_names[j.peer] =
          detail::cat("rank ", j.peer, " (", net::endpoint(ep.host, ep.port), ")");
    }
    j.fd = net::connect_to(j.host, j.port, deadline_);
    j.nonce = fresh_nonce();
    j.got = 0;
    const Hello h = hello(static_cast<uint32_t>(j.stream), j.nonce);
    net::send_all(j.fd.get(), &h, sizeof(h), deadline_, mesh_.peer_names[j.peer]);
  }

  // True once the join is complete. A listener that closes before
  // answering dropped it among too many pending connections: connect again.
  bool advance_join(Join& j) {
    const std::string& name = mesh_.peer_names[j.peer];
    const size_t want = sizeof(Hello) + (has_token() ? sizeof(store_auth::Proof) : 0);
    const Read r = read_some(j.fd.get(), j.answer, j.got < sizeof(Hello) ? sizeof(Hello) : want,
                             j.got);
    Hello h{};
    std::memcpy(&h, j.answer, std::min(j.got, sizeof(Hello)));
    if (j.got >= sizeof(Hello) && (h.flags & kHelloRefused) && h.magic == kHelloMagic)
      throw NetworkError(detail::cat("tcp: group '", options_.name, "': ", name,
                                     " refused this rank's connection: ",
                                     refusal_text(h.eager_kib)));
    if (r == Read::kClosed) {
      ++j.closed;
      warn_once(detail::cat("tcp: group '", options_.name, "': ", name,
                                " closed a connection before answering (too many connections "
                                "pending there); connecting again"));
      open_join(j);
      return false;
    }
    if (r == Read::kMore) return false;
    if (j.got == sizeof(Hello) && want > sizeof(Hello)) return advance_join(j);  // the proof
    if (h.magic != kHelloMagic || h.version != kHelloVersion || h.group_id != id_ ||
        h.rank != static_cast<uint32_t>(j.peer) || h.stream != static_cast<uint32_t>(j.stream) ||
        h.eager_kib == 0)
      throw NetworkError(detail::cat("tcp: group '", options_.name, "': ", name,
                                     " answered with a hello of another group, rank or dtrain "
                                     "version"));
    if (has_token()) prove(j, h);
    set_nodelay(j.fd.get());
    mesh_.grants[j.peer][j.stream] = uint64_t{h.eager_kib} << 10;
    mesh_.conns[j.peer][j.stream] = std::move(j.fd);
    j.done = true;
    return true;
  }

  // Checks the acceptor's proof, then sends the joiner's.
  void prove(Join& j, const Hello& h) {
    const std::string& name = mesh_.peer_names[j.peer];
    const auto want = store_auth::proof(options_.token, kAcceptorRole, j.nonce, h.nonce);
    if (!store_auth::matches(want, j.answer + sizeof(Hello), sizeof(store_auth::Proof)))
      throw NetworkError(detail::cat("tcp: group '", options_.name, "': ", name,
                                     " does not hold this job's token (is DTRAIN_STORE_TOKEN the "
                                     "same on every rank?)"));
    const auto ours = store_auth::proof(options_.token, kJoinerRole, h.nonce, j.nonce);
    net::send_all(j.fd.get(), ours.data(), ours.size(), deadline_, name);
  }

  void warn_once(const std::string& text) {
    if (evicted_logged_) return;
    evicted_logged_ = true;
    log_warning(text);
  }

  // ---- accepting higher ranks ----------------------------------------------

  // Accepts what is waiting (a batch at most). Beyond kMaxSilent
  // connections without a whole hello, the oldest of them makes room.
  void accept_some(std::vector<Pending>& pending) {
    const auto silent = [](const Pending& p) { return !p.replied; };
    size_t silent_count = static_cast<size_t>(std::count_if(pending.begin(), pending.end(), silent));
    for (size_t n = 0; n < kAcceptBatch; ++n) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      net::Fd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&ss), &len,
                           SOCK_CLOEXEC));
      if (!fd) {  // EAGAIN: the listener does not block
        if (errno == EMFILE || errno == ENFILE)
          throw NetworkError(detail::cat(
              "tcp: group '", options_.name, "' rank ", rank_, " cannot accept its peers' "
              "connections: ", strerror(errno), " (RLIMIT_NOFILE; raise it with ulimit -n)"));
        return;
      }
      if (silent_count >= kMaxSilent) {
        auto oldest = std::find_if(pending.begin(), pending.end(), silent);
        drop(*oldest, "too many connections without a hello");
        pending.erase(oldest);
        --silent_count;
      }
      Pending p;
      p.peer = peer_of(ss, len);
      p.fd = std::move(fd);
      pending.push_back(std::move(p));
      ++silent_count;
    }
  }

  enum class Step { kWaiting, kAdopted, kDropped };

  // One pending connection, as far as its bytes allow: the hello (its
  // first 8 bytes checked before the rest is awaited, so an older peer is
  // named instead of waited for), the reply, the joiner's proof, adoption.
  Step advance(Pending& p) {
    auto* raw = reinterpret_cast<uint8_t*>(&p.hello);
    if (!p.replied) {
      const size_t want = p.got < 8 ? 8 : sizeof(Hello);
      const Read r = read_some(p.fd.get(), raw, want, p.got);
      if (r == Read::kClosed) return Step::kDropped;
      if (r == Read::kMore) return Step::kWaiting;
      if (want == 8) {
        if (const char* why = preamble_problem(p.hello)) return drop(p, why);
        return advance(p);  // the rest of the hello
      }
      if (const char* why = preamble_problem(p.hello)) return drop(p, why);
      if (auto refusal = hello_problem(p.hello)) return refuse(p, *refusal);
      try {
        reply(p);
      } catch (const NetworkError&) {
        // It left before our reply (a joiner that refused another stream's
        // reply, or a stranger): not this rank's failure, keep waiting.
        return drop(p, "closed the connection before this rank's reply");
      }
      p.got = 0;
      if (!has_token()) return adopt(p);
    }
    const Read r = read_some(p.fd.get(), p.proof.data(), p.proof.size(), p.got);
    if (r == Read::kClosed) return Step::kDropped;
    if (r == Read::kMore) return Step::kWaiting;
    const auto want = store_auth::proof(options_.token, kJoinerRole, p.nonce, p.hello.nonce);
    if (!store_auth::matches(want, p.proof.data(), p.proof.size()))
      return drop(p, "wrong job token proof (is DTRAIN_STORE_TOKEN the same on every rank?)");
    return adopt(p);
  }

  static const char* preamble_problem(const Hello& h) {
    if (h.magic != kHelloMagic) return "not a dtrain tcp hello";
    if (h.version != kHelloVersion) return "another dtrain version";
    return nullptr;
  }

  std::optional<Refusal> hello_problem(const Hello& h) const {
    if (h.group_id != id_) return Refusal::kAnotherGroup;
    if (h.rank <= static_cast<uint32_t>(rank_) || h.rank >= static_cast<uint32_t>(size_) ||
        !scope_.wants(static_cast<int>(h.rank)) ||
        h.stream >= static_cast<uint32_t>(options_.streams) || h.eager_kib == 0)
      return Refusal::kOutOfRange;
    const bool theirs = (h.flags & kHelloHasToken) != 0;
    if (theirs && !has_token()) return Refusal::kTokenOnJoinerOnly;
    if (!theirs && has_token()) return Refusal::kTokenOnAcceptorOnly;
    return std::nullopt;
  }

  // Tells the joiner why (a hello flagged kHelloRefused), then drops it.
  Step refuse(Pending& p, Refusal why) {
    Hello h = hello(p.hello.stream, store_auth::Nonce{});
    h.flags = kHelloRefused;
    h.eager_kib = static_cast<uint32_t>(why);
    (void)!::send(p.fd.get(), &h, sizeof(h), MSG_DONTWAIT | MSG_NOSIGNAL);
    switch (why) {  // worded from this rank's side: "it" is the joiner
      case Refusal::kAnotherGroup:
        return drop(p, "another group");
      case Refusal::kOutOfRange:
        return drop(p, "rank or stream out of range");
      case Refusal::kTokenOnJoinerOnly:
        return drop(p, "it uses a job token and this rank has none (is DTRAIN_STORE_TOKEN set "
                       "on every rank?)");
      case Refusal::kTokenOnAcceptorOnly:
        break;
    }
    return drop(p, "it has no job token and this rank has one (is DTRAIN_STORE_TOKEN set on "
                   "every rank?)");
  }

  // One log line per second at most, so strangers cannot flood the log;
  // the count of the others goes with the next line.
  Step drop(Pending& p, const char* why) {
    const auto now = Clock::now();
    if (now - last_drop_log_ < std::chrono::seconds(1)) {
      ++drops_unlogged_;
      return Step::kDropped;
    }
    log_warning(detail::cat("tcp: group '", options_.name, "' closed a connection from ", p.peer,
                            ": ", why,
                            drops_unlogged_ ? detail::cat(" (and ", drops_unlogged_,
                                                          " more in the last second)")
                                            : std::string()));
    last_drop_log_ = now;
    drops_unlogged_ = 0;
    return Step::kDropped;
  }

  // Our hello (and, with a token, our proof) to a joiner whose hello passed.
  void reply(Pending& p) {
    p.nonce = fresh_nonce();
    const Hello h = hello(p.hello.stream, p.nonce);
    net::send_all(p.fd.get(), &h, sizeof(h), deadline_, p.peer);
    if (has_token()) {
      const auto proof = store_auth::proof(options_.token, kAcceptorRole, p.hello.nonce, p.nonce);
      net::send_all(p.fd.get(), proof.data(), proof.size(), deadline_, p.peer);
    }
    p.replied = true;
  }

  // Takes a connection that completed the handshake for a stream not yet
  // taken.
  Step adopt(Pending& p) {
    const Hello& h = p.hello;
    if (mesh_.conns[h.rank][h.stream]) return drop(p, "duplicate stream");
    set_nodelay(p.fd.get());
    mesh_.peer_names[h.rank] = detail::cat("rank ", h.rank, " (", p.peer, ")");
    mesh_.grants[h.rank][h.stream] = uint64_t{h.eager_kib} << 10;
    mesh_.conns[h.rank][h.stream] = std::move(p.fd);
    return Step::kAdopted;
  }

  TimeoutError timeout_naming_missing() const {
    std::string higher, lower;
    for (int p = rank_ + 1; p < size_ && scope_.higher; ++p) {
      if (!scope_.wants(p)) continue;
      int open = 0;
      for (const auto& fd : mesh_.conns[p]) open += fd ? 1 : 0;
      if (open < options_.streams) higher += detail::cat(higher.empty() ? "" : ", ", p);
    }
    int closed = 0, last = -1;
    for (const auto& j : joins_) {
      if (j.done) continue;
      closed += j.closed;
      if (j.peer == last) continue;
      lower += detail::cat(lower.empty() ? "" : ", ", j.peer);
      last = j.peer;
    }
    std::string text = detail::cat("tcp: group '", options_.name, "' rank ", rank_, ":");
    if (!higher.empty()) text += detail::cat(" ranks ", higher, " did not connect");
    if (!lower.empty())
      text += detail::cat(higher.empty() ? "" : ";", " ranks ", lower,
                          " did not answer this rank's connections",
                          closed ? detail::cat(" (closed ", closed,
                                               " of them unanswered: too many connections "
                                               "pending there?)")
                                 : std::string());
    return TimeoutError(detail::cat(text, " within ", options_.timeout.count(), " ms"));
  }

  Store& store_;
  const int rank_, size_;
  const TcpOptions& options_;
  const MeshScope scope_;
  const Clock::time_point deadline_;
  const uint64_t grant_;
  net::Fd listener_;
  uint64_t id_ = 0;
  std::vector<Join> joins_;
  size_t missing_ = 0;  // connections from higher ranks not adopted yet
  bool evicted_logged_ = false;
  Clock::time_point last_drop_log_{};
  size_t drops_unlogged_ = 0;
  Mesh mesh_;
};

}  // namespace

Mesh connect_mesh(Store& store, int rank, int size, const TcpOptions& options,
                  const MeshScope& scope) {
  DTRAIN_CHECK_ARG(options.streams >= 1 && options.streams <= 16,
                   "tcp: streams must be 1..16, got ", options.streams);
  return MeshBuilder(store, rank, size, options, scope).build();
}

}  // namespace dtrain::transport::tcp
