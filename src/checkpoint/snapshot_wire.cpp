#include "checkpoint/snapshot_wire.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <algorithm>
#include <cstring>

#include "common/enforce.h"
#include "common/socket.h"
#include "dtrain/errors.h"

namespace dtrain::snapshot_wire {
namespace {

constexpr char kMagic[4] = {'D', 'T', 'S', 'N'};
constexpr size_t kRequestHead = 4 + 4 + 8 + 4 + 4 + 8;
constexpr size_t kReplyHead = 4 + 8;

template <typename T>
void put(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}

template <typename T>
T get(const char* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return static_cast<T>(v);
}

// Reads the fixed-size fields of a listing one by one, never past the end.
struct Cursor {
  const std::string& bytes;
  const std::string& what;
  size_t at = 0;
  template <typename T>
  T next(const char* field) {
    DTRAIN_CHECK_ARG(bytes.size() - at >= sizeof(T), what, ": the listing ends inside its ", field);
    const T v = get<T>(bytes.data() + at);
    at += sizeof(T);
    return v;
  }
};

net::Fd connect_unix(const std::string& path, const std::string& context) {
  sockaddr_un addr{};
  DTRAIN_CHECK_ARG(path.size() < sizeof(addr.sun_path), context, ": the snapshot keeper's socket path ", path,
                   " is longer than ", sizeof(addr.sun_path) - 1, " bytes");
  net::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw NetworkError(context + ": cannot make a socket: " + std::strerror(errno));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    throw NetworkError(context + ": cannot reach this host's snapshot keeper at " + path + ": " +
                       std::strerror(errno) + " (is dtrain-run still running?)");
  return fd;
}

}  // namespace

std::string encode_listing(const Listing& l) {
  std::string out;
  put<uint64_t>(out, l.keeper);
  put<int64_t>(out, l.step);
  put<uint32_t>(out, l.world);
  put<uint32_t>(out, static_cast<uint32_t>(l.parts.size()));
  for (const auto& [rank, bytes] : l.parts) {
    put<uint32_t>(out, rank);
    put<uint64_t>(out, bytes);
  }
  return out;
}

Listing decode_listing(const std::string& bytes, const std::string& what) {
  Cursor c{bytes, what};
  Listing l;
  l.keeper = c.next<uint64_t>("keeper id");
  l.step = c.next<int64_t>("step");
  l.world = c.next<uint32_t>("world size");
  const auto n = c.next<uint32_t>("part count");
  DTRAIN_CHECK_ARG(l.world <= kMaxWorld && n <= l.world, what, ": ", n, " parts of a world of ", l.world);
  for (uint32_t i = 0; i < n; ++i) {
    const auto rank = c.next<uint32_t>("part's rank");
    const auto size = c.next<uint64_t>("part's size");
    DTRAIN_CHECK_ARG(rank < l.world && (l.parts.empty() || rank > l.parts.back().first), what,
                     ": part of rank ", rank, " out of order or outside the world of ", l.world);
    l.parts.emplace_back(rank, size);
  }
  DTRAIN_CHECK_ARG(c.at == bytes.size(), what, ": ", bytes.size() - c.at, " bytes after the listing");
  return l;
}

std::string call(const std::string& socket_path, const Request& r, uint64_t max_answer,
                 Clock::time_point deadline, const std::string& context) {
  net::Fd fd = connect_unix(socket_path, context);
  const std::string peer = "the snapshot keeper at " + socket_path;
  std::string head(kMagic, 4);
  put<uint32_t>(head, static_cast<uint32_t>(r.op));
  put<int64_t>(head, r.step);
  put<uint32_t>(head, r.rank);
  put<uint32_t>(head, r.world);
  put<uint64_t>(head, r.payload.size());
  try {
    net::send_all(fd.get(), head.data(), head.size(), deadline, peer);
    net::send_all(fd.get(), r.payload.data(), r.payload.size(), deadline, peer);
    char reply[kReplyHead];
    net::recv_all(fd.get(), reply, sizeof(reply), deadline, peer);
    const auto status = get<uint32_t>(reply);
    const auto n = get<uint64_t>(reply + 4);
    DTRAIN_CHECK_ARG(n <= std::max<uint64_t>(max_answer, 4096), context, ": ", peer, " answered with ", n,
                     " bytes, more than the ", max_answer, " expected");
    std::string body(n, '\0');
    net::recv_all(fd.get(), body.data(), n, deadline, peer);
    if (status != 0) throw Error(context + ": " + body);
    return body;
  } catch (const TimeoutError& e) {
    throw TimeoutError(context + ": " + e.what());
  } catch (const NetworkError& e) {
    throw NetworkError(context + ": " + e.what());
  }
}

Request read_request(int fd, uint64_t max_payload, Clock::time_point deadline) {
  const std::string peer = "a worker";
  char head[kRequestHead];
  net::recv_all(fd, head, sizeof(head), deadline, peer);
  DTRAIN_CHECK_ARG(std::memcmp(head, kMagic, 4) == 0, "snapshot keeper: a request without the protocol's magic");
  Request r;
  const auto op = get<uint32_t>(head + 4);
  DTRAIN_CHECK_ARG(op >= 1 && op <= kLastOp, "snapshot keeper: unknown operation ", op);
  r.op = static_cast<Op>(op);
  r.step = get<int64_t>(head + 8);
  r.rank = get<uint32_t>(head + 16);
  r.world = get<uint32_t>(head + 20);
  const auto n = get<uint64_t>(head + 24);
  DTRAIN_CHECK_ARG(r.world <= kMaxWorld, "snapshot keeper: a world of ", r.world, " ranks (at most ", kMaxWorld, ")");
  DTRAIN_CHECK_ARG(r.op == Op::List || r.rank < r.world, "snapshot keeper: rank ", r.rank,
                   " is not below the world size ", r.world);
  DTRAIN_CHECK_ARG(n <= max_payload, "snapshot keeper: a part of ", n, " bytes is over the ", max_payload,
                   " bytes this keeper may still hold");
  DTRAIN_CHECK_ARG(r.op == Op::Put || n == 0, "snapshot keeper: operation ", op, " carries no payload");
  r.payload.resize(n);
  net::recv_all(fd, r.payload.data(), n, deadline, peer);
  return r;
}

void write_reply(int fd, bool ok, const std::string& body, Clock::time_point deadline) {
  std::string head;
  put<uint32_t>(head, ok ? 0u : 1u);
  put<uint64_t>(head, body.size());
  net::send_all(fd, head.data(), head.size(), deadline, "a worker");
  net::send_all(fd, body.data(), body.size(), deadline, "a worker");
}

}  // namespace dtrain::snapshot_wire
