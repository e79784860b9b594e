#include "transport/tcp/mesh.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/enforce.h"
#include "common/logging.h"
#include "transport/tcp/hello.h"

namespace dtrain::transport::tcp {
namespace {

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

// Reads what has arrived of `want` bytes into `buf` (`got` so far); true
// once complete. A connection that closes or fails is dropped (false, fd
// reset).
bool read_some(Pending& p, void* buf, size_t want) {
  auto* bytes = static_cast<uint8_t*>(buf);
  for (;;) {
    const ssize_t n = ::recv(p.fd.get(), bytes + p.got, want - p.got, MSG_DONTWAIT);
    if (n > 0) {
      p.got += static_cast<size_t>(n);
      if (p.got == want) return true;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    p.fd.reset();
    return false;
  }
}

std::string peer_of(const sockaddr_storage& ss, socklen_t len) {
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  getnameinfo(reinterpret_cast<const sockaddr*>(&ss), len, host, sizeof(host), port,
              sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV);
  return net::endpoint(host, static_cast<uint16_t>(std::atoi(port)));
}

// Connections in the middle of their handshake, at most: a flood of
// strangers costs this many descriptors, not more.
constexpr size_t kMaxPending = 256;

class MeshBuilder {
 public:
  MeshBuilder(Store& store, int rank, int size, const TcpOptions& options)
      : store_(store), rank_(rank), size_(size), options_(options),
        deadline_(Clock::now() + options.timeout) {
    mesh_.conns.resize(size);
    mesh_.peer_names.resize(size);
    for (int p = 0; p < size; ++p)
      if (p != rank) mesh_.conns[p].resize(options.streams);
  }

  Mesh build() {
    publish();
    connect_lower();
    accept_higher();
    confirm_lower();
    return std::move(mesh_);
  }

 private:
  void publish() {
    const std::string host =
        options_.local_address.empty() ? "127.0.0.1" : options_.local_address;
    uint16_t port = 0;
    listener_ = net::listen_on(host, 0, &port);
    if (rank_ == 0) {
      id_ = random_id();
      store_.set("tcp/id", std::to_string(id_));
    }
    store_.set("tcp/addr/" + std::to_string(rank_), host + "\n" + std::to_string(port));
    if (rank_ != 0) id_ = std::stoull(store_.get_string("tcp/id"));
  }

  bool has_token() const { return !options_.token.empty(); }

  Hello hello(uint32_t stream, const store_auth::Nonce& nonce) const {
    return Hello{kHelloMagic, kHelloVersion, id_, static_cast<uint32_t>(rank_), stream,
                 has_token() ? kHelloHasToken : 0u, 0, nonce};
  }

  store_auth::Nonce fresh_nonce() const {
    return has_token() ? store_auth::random_nonce() : store_auth::Nonce{};
  }

  void connect_lower() {
    joiner_nonces_.resize(rank_);
    for (int p = 0; p < rank_; ++p) {
      const auto ep = parse_endpoint(store_.get_string("tcp/addr/" + std::to_string(p)), p);
      mesh_.peer_names[p] = detail::cat("rank ", p, " (", net::endpoint(ep.host, ep.port), ")");
      for (int s = 0; s < options_.streams; ++s) {
        auto fd = net::connect_to(ep.host, ep.port, deadline_);
        joiner_nonces_[p].push_back(fresh_nonce());
        const Hello h = hello(static_cast<uint32_t>(s), joiner_nonces_[p].back());
        net::send_all(fd.get(), &h, sizeof(h), deadline_, mesh_.peer_names[p]);
        set_nodelay(fd.get());
        mesh_.conns[p][s] = std::move(fd);
      }
    }
  }

  // Accepts until every higher rank has opened every stream. Handshakes
  // are read without blocking, so a stranger that connects and stays
  // silent holds up nobody; at most kMaxPending are kept (the oldest is
  // dropped first).
  void accept_higher() {
    size_t missing = static_cast<size_t>(size_ - 1 - rank_) * options_.streams;
    std::vector<Pending> pending;
    while (missing > 0) {
      std::vector<pollfd> fds{{listener_.get(), POLLIN, 0}};
      for (auto& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ -
                                                                              Clock::now());
      if (left.count() <= 0) throw timeout_naming_missing();
      const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(
                                                        left.count(), 1000)));
      if (rc < 0 && errno != EINTR)
        throw NetworkError(detail::cat("tcp: poll failed: ", strerror(errno)));
      if (rc <= 0) continue;
      if (fds[0].revents & POLLIN) accept_one(pending);
      for (auto it = pending.begin(); it != pending.end();) {
        const Step step = advance(*it);
        if (step == Step::kWaiting) {
          ++it;
          continue;
        }
        if (step == Step::kAdopted) --missing;
        it = pending.erase(it);
      }
    }
  }

  void accept_one(std::vector<Pending>& pending) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    net::Fd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC));
    if (!fd) return;
    if (pending.size() >= kMaxPending) pending.erase(pending.begin());
    Pending p;
    p.peer = peer_of(ss, len);
    p.fd = std::move(fd);
    pending.push_back(std::move(p));
  }

  enum class Step { kWaiting, kAdopted, kDropped };

  // One pending connection, as far as its bytes allow: the hello (its
  // first 8 bytes checked before the rest is awaited, so an older peer is
  // named instead of waited for), the reply, the joiner's proof, adoption.
  Step advance(Pending& p) {
    auto* raw = reinterpret_cast<uint8_t*>(&p.hello);
    if (!p.replied) {
      const size_t want = p.got < 8 ? 8 : sizeof(Hello);
      const bool done = read_some(p, raw, want);
      if (!p.fd) return Step::kDropped;
      if (!done) return Step::kWaiting;
      if (want == 8) {
        if (const char* why = preamble_problem(p.hello)) return drop(p, why);
        return advance(p);  // the rest of the hello
      }
      if (const char* why = hello_problem(p.hello)) return drop(p, why);
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
    if (!read_some(p, p.proof.data(), p.proof.size()))
      return p.fd ? Step::kWaiting : Step::kDropped;
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

  const char* hello_problem(const Hello& h) const {
    if (const char* why = preamble_problem(h)) return why;
    if (h.group_id != id_) return "another group";
    if (h.rank <= static_cast<uint32_t>(rank_) || h.rank >= static_cast<uint32_t>(size_))
      return "rank out of range";
    if (h.stream >= static_cast<uint32_t>(options_.streams)) return "stream out of range";
    const bool theirs = (h.flags & kHelloHasToken) != 0;
    if (theirs && !has_token())
      return "it uses a job token and this rank has none (is DTRAIN_STORE_TOKEN set on every "
             "rank?)";
    if (!theirs && has_token())
      return "it has no job token and this rank has one (is DTRAIN_STORE_TOKEN set on every "
             "rank?)";
    return nullptr;
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
    mesh_.conns[h.rank][h.stream] = std::move(p.fd);
    return Step::kAdopted;
  }

  // Each lower rank answers every stream with its own hello (and proof):
  // the listener we reached is that rank of this group, holding the token.
  void confirm_lower() {
    for (int p = 0; p < rank_; ++p) {
      for (int s = 0; s < options_.streams; ++s) {
        const int fd = mesh_.conns[p][s].get();
        const std::string& name = mesh_.peer_names[p];
        Hello h{};
        try {
          net::recv_all(fd, &h, sizeof(h), deadline_, name);
        } catch (const NetworkError& e) {  // closed: it refused our hello (and logged why)
          throw NetworkError(detail::cat(
              "tcp: group '", options_.name, "': ", e.what(),
              " during the handshake: it refused this rank's hello (is DTRAIN_STORE_TOKEN set on "
              "every rank, with the same value? are all ranks the same dtrain version?)"));
        }
        if (h.magic != kHelloMagic || h.version != kHelloVersion || h.group_id != id_ ||
            h.rank != static_cast<uint32_t>(p) || h.stream != static_cast<uint32_t>(s))
          throw NetworkError(detail::cat("tcp: group '", options_.name, "': ", name,
                                         " answered with a hello of another group or rank"));
        if (!has_token()) continue;
        store_auth::Proof theirs{};
        net::recv_all(fd, theirs.data(), theirs.size(), deadline_, name);
        const auto want =
            store_auth::proof(options_.token, kAcceptorRole, joiner_nonces_[p][s], h.nonce);
        if (!store_auth::matches(want, theirs.data(), theirs.size()))
          throw NetworkError(detail::cat("tcp: group '", options_.name, "': ", name,
                                         " does not hold this job's token (is "
                                         "DTRAIN_STORE_TOKEN the same on every rank?)"));
        const auto ours =
            store_auth::proof(options_.token, kJoinerRole, h.nonce, joiner_nonces_[p][s]);
        net::send_all(fd, ours.data(), ours.size(), deadline_, name);
      }
    }
  }

  TimeoutError timeout_naming_missing() const {
    std::string missing;
    for (int p = rank_ + 1; p < size_; ++p) {
      int open = 0;
      for (const auto& fd : mesh_.conns[p]) open += fd ? 1 : 0;
      if (open < options_.streams) missing += detail::cat(missing.empty() ? "" : ", ", p);
    }
    return TimeoutError(detail::cat("tcp: group '", options_.name, "' rank ", rank_,
                                    ": ranks ", missing, " did not connect within ",
                                    options_.timeout.count(), " ms"));
  }

  Store& store_;
  const int rank_, size_;
  const TcpOptions& options_;
  const Clock::time_point deadline_;
  net::Fd listener_;
  uint64_t id_ = 0;
  std::vector<std::vector<store_auth::Nonce>> joiner_nonces_;  // [lower rank][stream]
  Clock::time_point last_drop_log_{};
  size_t drops_unlogged_ = 0;
  Mesh mesh_;
};

}  // namespace

Mesh connect_mesh(Store& store, int rank, int size, const TcpOptions& options) {
  DTRAIN_CHECK_ARG(options.streams >= 1 && options.streams <= 16,
                   "tcp: streams must be 1..16, got ", options.streams);
  return MeshBuilder(store, rank, size, options).build();
}

}  // namespace dtrain::transport::tcp
