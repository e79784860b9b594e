#include "checkpoint/storage/keepers/wire.h"

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
constexpr size_t kRequestHead = 4 + 4 + 8 + 4 + 4 + 4 + 8;
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

// n bytes, each chunk within kStall: a stall is bounded, a long transfer not.
void recv_chunks(int fd, char* data, size_t n, const std::string& peer) {
  for (size_t at = 0; at < n;) {
    const size_t len = std::min(kChunk, n - at);
    net::recv_all(fd, data + at, len, Clock::now() + kStall, peer);
    at += len;
  }
}
void send_chunks(int fd, const char* data, size_t n, const std::string& peer) {
  for (size_t at = 0; at < n;) {
    const size_t len = std::min(kChunk, n - at);
    net::send_all(fd, data + at, len, Clock::now() + kStall, peer);
    at += len;
  }
}

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

namespace {

void put_parts(std::string& out, int64_t step, uint32_t world, const std::vector<std::pair<uint32_t, uint64_t>>& parts) {
  put<int64_t>(out, step);
  put<uint32_t>(out, world);
  put<uint32_t>(out, static_cast<uint32_t>(parts.size()));
  for (const auto& [rank, bytes] : parts) {
    put<uint32_t>(out, rank);
    put<uint64_t>(out, bytes);
  }
}

void next_parts(Cursor& c, int64_t& step, uint32_t& world, std::vector<std::pair<uint32_t, uint64_t>>& parts) {
  const std::string& what = c.what;
  step = c.next<int64_t>("step");
  world = c.next<uint32_t>("world size");
  const auto n = c.next<uint32_t>("part count");
  DTRAIN_CHECK_ARG(world <= kMaxWorld && n <= world, what, ": ", n, " parts of a world of ", world);
  for (uint32_t i = 0; i < n; ++i) {
    const auto rank = c.next<uint32_t>("part's rank");
    const auto size = c.next<uint64_t>("part's size");
    DTRAIN_CHECK_ARG(rank < world && (parts.empty() || rank > parts.back().first), what, ": part of rank ", rank,
                     " out of order or outside the world of ", world);
    parts.emplace_back(rank, size);
  }
}

}  // namespace

std::string encode_listing(const Listing& l) {
  std::string out;
  put<uint64_t>(out, l.keeper);
  put_parts(out, l.step, l.world, l.parts);
  put_parts(out, l.writing_step, l.writing_world, l.writing_parts);
  return out;
}

Listing decode_listing(const std::string& bytes, const std::string& what) {
  Cursor c{bytes, what};
  Listing l;
  l.keeper = c.next<uint64_t>("keeper id");
  next_parts(c, l.step, l.world, l.parts);
  next_parts(c, l.writing_step, l.writing_world, l.writing_parts);
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
  put<uint32_t>(head, static_cast<uint32_t>(r.group.size()));
  put<uint64_t>(head, r.payload.size());
  head += r.group;
  try {
    net::send_all(fd.get(), head.data(), head.size(), deadline, peer);
    try {
      net::send_all(fd.get(), r.payload.data(), r.payload.size(), deadline, peer);
    } catch (const NetworkError&) {
      // A keeper that refuses a part unread answers and closes: its answer
      // is still there to read. None there: the send's error stands.
    }
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

Head read_head(int fd) {
  const std::string peer = "a worker";
  char head[kRequestHead];
  recv_chunks(fd, head, sizeof(head), peer);
  DTRAIN_CHECK_ARG(std::memcmp(head, kMagic, 4) == 0, "snapshot keeper: a request without the protocol's magic");
  Head h;
  const auto op = get<uint32_t>(head + 4);
  DTRAIN_CHECK_ARG(op >= 1 && op <= kLastOp, "snapshot keeper: unknown operation ", op);
  h.op = static_cast<Op>(op);
  h.step = get<int64_t>(head + 8);
  h.rank = get<uint32_t>(head + 16);
  h.world = get<uint32_t>(head + 20);
  const auto g = get<uint32_t>(head + 24);
  h.payload_bytes = get<uint64_t>(head + 28);
  DTRAIN_CHECK_ARG(h.world <= kMaxWorld, "snapshot keeper: a world of ", h.world, " ranks (at most ", kMaxWorld, ")");
  DTRAIN_CHECK_ARG(h.op == Op::List || h.rank < h.world, "snapshot keeper: rank ", h.rank,
                   " is not below the world size ", h.world);
  DTRAIN_CHECK_ARG(g <= kMaxGroupKey, "snapshot keeper: a group key of ", g, " bytes (at most ", kMaxGroupKey, ")");
  DTRAIN_CHECK_ARG(h.op == Op::Put || h.payload_bytes == 0, "snapshot keeper: operation ", op, " carries no payload");
  h.group.resize(g);
  recv_chunks(fd, h.group.data(), g, peer);
  return h;
}

Request read_payload(int fd, Head h) {
  Request r{h.op, h.step, h.rank, h.world, {}, std::move(h.group)};
  r.payload.resize(h.payload_bytes);
  recv_chunks(fd, r.payload.data(), r.payload.size(), "a worker");
  return r;
}

Request read_request(int fd, uint64_t max_payload) {
  Head h = read_head(fd);
  DTRAIN_CHECK_ARG(h.payload_bytes <= max_payload, "snapshot keeper: a part of ", h.payload_bytes,
                   " bytes is over the ", max_payload, " bytes this keeper may still hold");
  return read_payload(fd, std::move(h));
}

void write_reply(int fd, bool ok, const std::string& body) {
  std::string head;
  put<uint32_t>(head, ok ? 0u : 1u);
  put<uint64_t>(head, body.size());
  send_chunks(fd, head.data(), head.size(), "a worker");
  send_chunks(fd, body.data(), body.size(), "a worker");
}

}  // namespace dtrain::snapshot_wire
