#include "checkpoint/snapshot_keeper.h"
#include "dtrain/checkpoint/snapshot_keeper.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "common/env.h"
#include "common/socket.h"
#include "dtrain/errors.h"

namespace dtrain::snapshot {
namespace {

using snapshot_wire::Op;
using snapshot_wire::Request;

// A worker has this long for one request (a part of a few GiB over a Unix
// socket takes seconds); a stalled one is dropped, the keeper goes on.
constexpr auto kRequestTimeout = std::chrono::minutes(5);

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

uint64_t host_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : (8ull << 30);
}

}  // namespace

uint64_t default_memory_limit() {
  const auto text = env::get(env::kSnapshotMemory);
  if (!text || text->empty()) return host_memory() / 2;
  const std::string& t = *text;
  size_t used = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(t, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  uint64_t scale = 1;
  if (used + 1 == t.size()) scale = t[used] == 'K' ? 1ull << 10 : t[used] == 'M' ? 1ull << 20 : t[used] == 'G' ? 1ull << 30 : 0;
  if (used == 0 || t[0] == '-' || (used != t.size() && used + 1 != t.size()) || scale == 0 || n == 0 ||
      n > (~0ull) / scale)
    throw InvalidArgument(std::string(env::kSnapshotMemory.name) + "='" + t +
                          "' is not a positive number of bytes (optionally with K, M or G)");
  return n * scale;
}

Keeper::Keeper(const std::string& parent_dir, uint64_t memory_limit) : memory_limit_(memory_limit) {
  std::random_device rd;
  id_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  std::string templ = parent_dir + "/dtrain-snapshots-XXXXXX";
  if (!::mkdtemp(templ.data())) throw Error(errno_text("snapshot keeper: cannot make a directory in " + parent_dir));
  dir_ = templ;  // mkdtemp makes it 0700
  socket_path_ = dir_ + "/keeper.sock";
  sockaddr_un addr{};
  if (socket_path_.size() >= sizeof(addr.sun_path)) {
    ::rmdir(dir_.c_str());
    throw Error("snapshot keeper: the socket path " + socket_path_ + " is too long; set TMPDIR to a shorter directory");
  }
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket_path_.data(), socket_path_.size());
  if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listen_fd_, 64) != 0 || ::pipe2(wake_, O_CLOEXEC) != 0) {
    const std::string why = errno_text("snapshot keeper: cannot listen on " + socket_path_);
    if (listen_fd_ >= 0) ::close(listen_fd_);
    ::unlink(socket_path_.c_str());
    ::rmdir(dir_.c_str());
    throw Error(why);
  }
  server_ = std::thread([this] { serve(); });
}

Keeper::~Keeper() {
  stopping_ = true;
  const char c = 0;
  (void)!::write(wake_[1], &c, 1);
  if (server_.joinable()) server_.join();
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
  ::unlink(socket_path_.c_str());
  ::rmdir(dir_.c_str());
}

uint64_t Keeper::bytes_held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return (complete_ ? complete_->bytes : 0) + (writing_ ? writing_->bytes : 0);
}

// One connection at a time: the workers of one host, each request bounded
// by kRequestTimeout.
void Keeper::serve() {
  while (!stopping_) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) continue;
    if (fds[1].revents) break;
    if (!(fds[0].revents & POLLIN)) continue;
    net::Fd fd(::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC));
    if (fd) serve_one(fd.get());
  }
}

void Keeper::serve_one(int fd) {
  const auto deadline = snapshot_wire::Clock::now() + kRequestTimeout;
  try {
    uint64_t room;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // A part may replace the one being written: its bytes count as room.
      room = memory_limit_ - std::min(memory_limit_, complete_ ? complete_->bytes : 0);
    }
    std::pair<bool, std::string> reply;
    try {
      reply = handle(snapshot_wire::read_request(fd, room, deadline));
    } catch (const InvalidArgument& e) {
      reply = {false, e.what()};
    }
    snapshot_wire::write_reply(fd, reply.first, reply.second, deadline);
  } catch (const Error&) {
    // The worker went away or stalled: its request did nothing.
  }
}

snapshot_wire::Listing Keeper::listing() const {
  snapshot_wire::Listing l;
  l.keeper = id_;
  if (complete_) {
    l.step = complete_->step;
    l.world = complete_->world;
    for (const auto& [rank, part] : complete_->parts) l.parts.emplace_back(rank, part.size());
  }
  return l;
}

std::pair<bool, std::string> Keeper::handle(Request r) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string of = "snapshot of step " + std::to_string(r.step);
  switch (r.op) {
    case Op::List:
      return {true, snapshot_wire::encode_listing(listing())};
    case Op::Get: {
      if (!complete_ || complete_->step != r.step || complete_->world != r.world)
        return {false, "this host's keeper holds no complete " + of + " of " + std::to_string(r.world) + " ranks"};
      auto it = complete_->parts.find(r.rank);
      if (it == complete_->parts.end())
        return {false, "this host's keeper holds no part of rank " + std::to_string(r.rank) + " of the " + of};
      return {true, it->second};
    }
    case Op::Put: {
      if (writing_ && (writing_->step != r.step || writing_->world != r.world)) writing_.reset();  // never completed
      if (!writing_) writing_ = Snapshot{r.step, r.world, {}, 0};
      auto& parts = writing_->parts;
      const uint64_t replaced = parts.count(r.rank) ? parts[r.rank].size() : 0;
      const uint64_t held = (complete_ ? complete_->bytes : 0) + writing_->bytes - replaced;
      if (held + r.payload.size() > memory_limit_)
        return {false, "this host's snapshot keeper would hold " + std::to_string(held + r.payload.size()) +
                           " bytes with rank " + std::to_string(r.rank) + "'s part, over its limit of " +
                           std::to_string(memory_limit_) + " (" + env::kSnapshotMemory.name + ")"};
      writing_->bytes = writing_->bytes - replaced + r.payload.size();
      parts[r.rank] = std::move(r.payload);
      return {true, ""};
    }
    case Op::Commit:
      if (writing_ && writing_->step == r.step && writing_->world == r.world) {
        complete_ = std::move(writing_);
        writing_.reset();
        return {true, ""};
      }
      if (complete_ && complete_->step == r.step && complete_->world == r.world) return {true, ""};  // said before
      return {false, "this host's keeper has no " + of + " being written"};
  }
  return {false, "unknown operation"};
}

}  // namespace dtrain::snapshot

namespace dtrain::checkpoint {

struct SnapshotKeeper::Impl {
  snapshot::Keeper keeper;
  Impl(const std::string& dir, uint64_t limit) : keeper(dir, limit) {}
};

SnapshotKeeper::SnapshotKeeper(uint64_t memory_limit, const std::string& parent_dir)
    : impl_(std::make_unique<Impl>(parent_dir.empty() ? "/tmp" : parent_dir, memory_limit)) {}
SnapshotKeeper::~SnapshotKeeper() = default;
const std::string& SnapshotKeeper::socket_path() const { return impl_->keeper.socket_path(); }
uint64_t SnapshotKeeper::bytes_held() const { return impl_->keeper.bytes_held(); }
uint64_t SnapshotKeeper::default_memory_limit() { return snapshot::default_memory_limit(); }

}  // namespace dtrain::checkpoint
