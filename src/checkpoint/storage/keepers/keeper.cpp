#include "checkpoint/storage/keepers/keeper.h"
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
  {
    // Connections still served end at once; their threads then finish.
    std::unique_lock<std::mutex> lock(mutex_);
    for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
    all_closed_.wait(lock, [&] { return open_.empty(); });
  }
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
  ::unlink(socket_path_.c_str());
  ::rmdir(dir_.c_str());
}

uint64_t Keeper::bytes_held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_;
}

// Each connection on a thread of its own, at most kMaxConnections at once
// (past that a connection is closed unanswered: the worker's call fails).
void Keeper::serve() {
  while (!stopping_) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) continue;
    if (fds[1].revents) break;
    if (!(fds[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (open_.size() >= static_cast<size_t>(kMaxConnections)) {
        ::close(fd);
        continue;
      }
      open_.insert(fd);
    }
    std::thread([this, fd] {
      serve_one(fd);
      std::lock_guard<std::mutex> lock(mutex_);
      open_.erase(fd);
      ::close(fd);  // under the mutex: the destructor never shuts down a reused number
      all_closed_.notify_all();
    }).detach();
  }
}

void Keeper::serve_one(int fd) {
  try {
    Reply reply;
    uint64_t reservation = 0;
    try {
      auto head = snapshot_wire::read_head(fd);
      if (head.op == Op::Put) {
        std::lock_guard<std::mutex> lock(mutex_);
        const std::string refused = over_limit(head, reserved_);
        if (!refused.empty()) {
          snapshot_wire::write_reply(fd, false, refused);  // its payload unread
          return;
        }
        reservation = head.payload_bytes;
        reserved_ += reservation;
      }
      reply = respond(snapshot_wire::read_payload(fd, std::move(head)), reservation);
      reservation = 0;  // respond() gave it back
    } catch (const InvalidArgument& e) {
      reply = {false, std::make_shared<const std::string>(e.what())};
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      reserved_ -= reservation;
      throw;
    }
    snapshot_wire::write_reply(fd, reply.ok, *reply.body);
  } catch (const std::exception&) {
    // The worker went away or stalled, or its part could not be allocated:
    // its request did nothing (and on a thread of its own, nothing may
    // escape: it would end dtrain-run).
  }
}

snapshot_wire::Listing Keeper::listing(const std::string& group) const {
  snapshot_wire::Listing l;
  l.keeper = id_;
  const auto it = kept_.find(group);
  if (it == kept_.end()) return l;
  if (const auto& c = it->second.complete) {
    l.step = c->step;
    l.world = c->world;
    for (const auto& [rank, part] : c->parts) l.parts.emplace_back(rank, part->size());
  }
  if (const auto& w = it->second.writing) {
    l.writing_step = w->step;
    l.writing_world = w->world;
    for (const auto& [rank, part] : w->parts) l.writing_parts.emplace_back(rank, part->size());
  }
  return l;
}

uint64_t Keeper::freed_by(const snapshot_wire::Head& h) const {
  const auto it = kept_.find(h.group);
  if (it == kept_.end() || !it->second.writing) return 0;
  const auto& w = *it->second.writing;
  if (w.step != h.step || w.world != h.world) return w.bytes;  // never completed: dropped
  const auto part = w.parts.find(h.rank);
  return part == w.parts.end() ? 0 : part->second->size();
}

std::string Keeper::over_limit(const snapshot_wire::Head& h, uint64_t reserved) const {
  const uint64_t would = bytes_ - freed_by(h) + reserved + h.payload_bytes;
  if (would <= memory_limit_ && would >= h.payload_bytes) return "";
  return "this host's snapshot keeper would hold " + std::to_string(would) + " bytes with rank " +
         std::to_string(h.rank) + "'s part, over its limit of " + std::to_string(memory_limit_) + " (" +
         env::kSnapshotMemory.name + ")";
}

std::pair<bool, std::string> Keeper::handle(Request r) {
  const Reply reply = respond(std::move(r), 0);
  return {reply.ok, *reply.body};
}

Keeper::Reply Keeper::respond(Request r, uint64_t reservation) {
  auto text = [](bool ok, std::string t) { return Reply{ok, std::make_shared<const std::string>(std::move(t))}; };
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_ -= reservation;
  const std::string of = "snapshot of step " + std::to_string(r.step);
  if (r.op == Op::List) return text(true, snapshot_wire::encode_listing(listing(r.group)));
  auto found = kept_.find(r.group);
  if (found == kept_.end()) {
    if (r.op != Op::Put) return text(false, "this host's keeper holds no snapshot of this group");
    if (kept_.size() >= kMaxGroups)
      return text(false, "this host's keeper already keeps the snapshots of " + std::to_string(kMaxGroups) +
                             " groups");
    found = kept_.emplace(r.group, Kept{}).first;
  }
  Kept& kept = found->second;
  switch (r.op) {
    case Op::List:
      break;
    case Op::Get: {  // from the complete snapshot, or the one being written (wire.h's Listing says when)
      const auto is = [&](const std::optional<Snapshot>& s) { return s && s->step == r.step && s->world == r.world; };
      const auto& from = is(kept.complete) ? kept.complete : kept.writing;
      if (!is(from))
        return text(false, "this host's keeper holds no " + of + " of " + std::to_string(r.world) + " ranks");
      auto it = from->parts.find(r.rank);
      if (it == from->parts.end())
        return text(false, "this host's keeper holds no part of rank " + std::to_string(r.rank) + " of the " + of);
      return {true, it->second};  // sent from where it is kept
    }
    case Op::Put: {
      const snapshot_wire::Head head{r.op, r.step, r.rank, r.world, r.group, r.payload.size()};
      const std::string refused = over_limit(head, reserved_);
      if (!refused.empty()) return text(false, refused);
      bytes_ -= freed_by(head);
      if (kept.writing && (kept.writing->step != r.step || kept.writing->world != r.world)) kept.writing.reset();
      if (!kept.writing) kept.writing = Snapshot{r.step, r.world, {}, 0};
      auto& w = *kept.writing;
      const auto old = w.parts.find(r.rank);
      if (old != w.parts.end()) w.bytes -= old->second->size();
      w.bytes += r.payload.size();
      bytes_ += r.payload.size();
      w.parts[r.rank] = std::make_shared<const std::string>(std::move(r.payload));
      return text(true, "");
    }
    case Op::Commit:
      if (kept.writing && kept.writing->step == r.step && kept.writing->world == r.world) {
        if (kept.complete) bytes_ -= kept.complete->bytes;
        kept.complete = std::move(kept.writing);
        kept.writing.reset();
        return text(true, "");
      }
      if (kept.complete && kept.complete->step == r.step && kept.complete->world == r.world)
        return text(true, "");  // said before
      return text(false, "this host's keeper has no " + of + " being written");
  }
  return text(false, "unknown operation");
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
