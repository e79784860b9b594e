#pragma once

// The snapshot keeper: the memory that holds checkpoint::snapshot()'s
// parts outside the worker processes, so that a restart of the workers
// (dtrain-run restarts all of them after any failure) does not end it.
// dtrain-run runs one per host, for as long as it runs, and tells its
// workers where it listens (DTRAIN_SNAPSHOT_SOCKET); torch-free.
//
// For each group (a request's group key: its name and ranks) it keeps at
// most two snapshots: the newest complete one, and the one being written
// (parts arriving for another step replace that one: it was never
// completed). A snapshot becomes complete when a worker says so, which
// checkpoint::snapshot does only once every rank's parts are kept where
// they should be. Memory is bounded by `memory_limit` bytes over every
// group: a part is admitted before its payload is read, counting what the
// keeper holds and the parts being read, and one that would pass the
// limit is refused unread (the snapshot then fails on every rank).
// Connections are served at once, each on a thread of its own (at most
// kMaxConnections), each bounded by the stall it may make (snapshot_wire's
// kStall), so a stalled worker holds up nobody else. A part is sent from
// where it is kept, without a copy.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "checkpoint/storage/keepers/wire.h"

namespace dtrain::snapshot {

class Keeper {
 public:
  static constexpr int kMaxConnections = 256;
  static constexpr size_t kMaxGroups = 1024;

  // Listens on a Unix socket in a new private directory (mode 0700) under
  // `parent_dir`. Throws dtrain::Error when it cannot.
  Keeper(const std::string& parent_dir, uint64_t memory_limit);
  ~Keeper();  // stops serving; the socket, its directory and every snapshot go
  Keeper(const Keeper&) = delete;
  Keeper& operator=(const Keeper&) = delete;

  const std::string& socket_path() const { return socket_path_; }
  uint64_t bytes_held() const;

  // One request, already read: the reply's status and body (public for the
  // keeper's unit test, which drives it without a socket).
  std::pair<bool, std::string> handle(snapshot_wire::Request request);

 private:
  using Part = std::shared_ptr<const std::string>;
  struct Snapshot {
    int64_t step = 0;
    uint32_t world = 0;
    std::map<uint32_t, Part> parts;
    uint64_t bytes = 0;
  };
  struct Kept {  // one group's
    std::optional<Snapshot> complete, writing;
  };
  struct Reply {
    bool ok = true;
    Part body;
  };
  void serve();
  void serve_one(int fd);
  // Under mutex_: the bytes installing `head`'s part would free (the part it
  // replaces, or the unfinished snapshot it drops), and the refusal when
  // holding it would pass the limit ("" when it fits), counting `reserved`
  // bytes of parts being read besides this one's.
  uint64_t freed_by(const snapshot_wire::Head& head) const;
  std::string over_limit(const snapshot_wire::Head& head, uint64_t reserved) const;
  Reply respond(snapshot_wire::Request request, uint64_t reservation);
  snapshot_wire::Listing listing(const std::string& group) const;

  mutable std::mutex mutex_;
  std::map<std::string, Kept> kept_;  // by group key
  uint64_t bytes_ = 0;                // the parts in kept_
  uint64_t reserved_ = 0;             // admitted parts being read
  const uint64_t memory_limit_;
  uint64_t id_ = 0;
  std::string dir_, socket_path_;
  int listen_fd_ = -1, wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::set<int> open_;  // connections being served
  std::condition_variable all_closed_;
  std::thread server_;
};

// The memory limit dtrain-run gives its keeper: DTRAIN_SNAPSHOT_MEMORY
// (bytes, with an optional K/M/G suffix), or half of this host's memory.
uint64_t default_memory_limit();

}  // namespace dtrain::snapshot
