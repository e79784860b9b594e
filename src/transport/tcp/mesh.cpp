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

namespace dtrain::transport::tcp {
namespace {

constexpr uint32_t kHelloMagic = 0x69485464;  // "dTHi"
constexpr uint32_t kHelloVersion = 1;

struct Hello {
  uint32_t magic;
  uint32_t version;
  uint64_t group_id;
  uint32_t rank;
  uint32_t stream;
};
static_assert(sizeof(Hello) == 24, "the hello is 24 bytes on the wire");

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

// An accepted connection whose hello has not fully arrived yet.
struct Pending {
  net::Fd fd;
  std::string peer;
  Hello hello{};
  size_t got = 0;
};

// Reads what has arrived of a pending hello; true once it is complete.
// A connection that closes or fails is dropped (false, fd reset).
bool read_hello(Pending& p) {
  auto* bytes = reinterpret_cast<uint8_t*>(&p.hello);
  for (;;) {
    const ssize_t n = ::recv(p.fd.get(), bytes + p.got, sizeof(Hello) - p.got, MSG_DONTWAIT);
    if (n > 0) {
      p.got += static_cast<size_t>(n);
      if (p.got == sizeof(Hello)) return true;
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

  Hello hello(uint32_t stream) const {
    return Hello{kHelloMagic, kHelloVersion, id_, static_cast<uint32_t>(rank_), stream};
  }

  void connect_lower() {
    for (int p = 0; p < rank_; ++p) {
      const auto ep = parse_endpoint(store_.get_string("tcp/addr/" + std::to_string(p)), p);
      mesh_.peer_names[p] = detail::cat("rank ", p, " (", net::endpoint(ep.host, ep.port), ")");
      for (int s = 0; s < options_.streams; ++s) {
        auto fd = net::connect_to(ep.host, ep.port, deadline_);
        const Hello h = hello(static_cast<uint32_t>(s));
        net::send_all(fd.get(), &h, sizeof(h), deadline_, mesh_.peer_names[p]);
        set_nodelay(fd.get());
        mesh_.conns[p][s] = std::move(fd);
      }
    }
  }

  // Accepts until every higher rank has opened every stream. Hellos are
  // read without blocking, so a stranger that connects and stays silent
  // holds up nobody.
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
        if (!read_hello(*it)) {
          it = it->fd ? it + 1 : pending.erase(it);
          continue;
        }
        if (adopt(*it)) --missing;
        it = pending.erase(it);
      }
    }
  }

  void accept_one(std::vector<Pending>& pending) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    net::Fd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC));
    if (!fd) return;
    Pending p;
    p.peer = peer_of(ss, len);
    p.fd = std::move(fd);
    pending.push_back(std::move(p));
  }

  // Takes a connection whose hello names this group and a higher rank's
  // unused stream; anything else is closed and logged.
  bool adopt(Pending& p) {
    const Hello& h = p.hello;
    const char* why = nullptr;
    if (h.magic != kHelloMagic) why = "not a dtrain tcp hello";
    else if (h.version != kHelloVersion) why = "another dtrain version";
    else if (h.group_id != id_) why = "another group";
    else if (h.rank <= static_cast<uint32_t>(rank_) || h.rank >= static_cast<uint32_t>(size_))
      why = "rank out of range";
    else if (h.stream >= static_cast<uint32_t>(options_.streams)) why = "stream out of range";
    else if (mesh_.conns[h.rank][h.stream]) why = "duplicate stream";
    if (why) {
      log_warning(detail::cat("tcp: group '", options_.name, "' closed a connection from ", p.peer,
                           ": ", why));
      return false;
    }
    const Hello reply = hello(h.stream);
    net::send_all(p.fd.get(), &reply, sizeof(reply), deadline_, p.peer);
    set_nodelay(p.fd.get());
    mesh_.peer_names[h.rank] = detail::cat("rank ", h.rank, " (", p.peer, ")");
    mesh_.conns[h.rank][h.stream] = std::move(p.fd);
    return true;
  }

  // Each lower rank answers every stream with its own hello: the listener
  // we reached is that rank of this group, not a stale port.
  void confirm_lower() {
    for (int p = 0; p < rank_; ++p) {
      for (int s = 0; s < options_.streams; ++s) {
        Hello h{};
        net::recv_all(mesh_.conns[p][s].get(), &h, sizeof(h), deadline_, mesh_.peer_names[p]);
        if (h.magic != kHelloMagic || h.group_id != id_ || h.rank != static_cast<uint32_t>(p) ||
            h.stream != static_cast<uint32_t>(s))
          throw NetworkError(detail::cat("tcp: group '", options_.name, "': ",
                                         mesh_.peer_names[p],
                                         " answered with a hello of another group or rank"));
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
  Mesh mesh_;
};

}  // namespace

Mesh connect_mesh(Store& store, int rank, int size, const TcpOptions& options) {
  DTRAIN_CHECK_ARG(options.streams >= 1 && options.streams <= 16,
                   "tcp: streams must be 1..16, got ", options.streams);
  return MeshBuilder(store, rank, size, options).build();
}

}  // namespace dtrain::transport::tcp
