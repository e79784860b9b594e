#pragma once

// The snapshot keeper: the memory that holds checkpoint::snapshot()'s
// parts outside the worker processes, so that a restart of the workers
// (dtrain-run restarts all of them after any failure) does not end it.
// dtrain-run runs one per host, for as long as it runs, and tells its
// workers where it listens (DTRAIN_SNAPSHOT_SOCKET); torch-free.
//
// It keeps at most two snapshots: the newest complete one, and the one
// being written (parts arriving for another step replace that one: it was
// never completed). A snapshot becomes complete when a worker says so,
// which checkpoint::snapshot does only once every rank's parts are kept
// where they should be. Memory is bounded by `memory_limit` bytes; a part
// that would pass it is refused, and the snapshot fails on every rank.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "checkpoint/snapshot_wire.h"

namespace dtrain::snapshot {

class Keeper {
 public:
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
  struct Snapshot {
    int64_t step = 0;
    uint32_t world = 0;
    std::map<uint32_t, std::string> parts;
    uint64_t bytes = 0;
  };
  void serve();
  void serve_one(int fd);
  snapshot_wire::Listing listing() const;

  mutable std::mutex mutex_;
  std::optional<Snapshot> complete_, writing_;
  const uint64_t memory_limit_;
  uint64_t id_ = 0;
  std::string dir_, socket_path_;
  int listen_fd_ = -1, wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::thread server_;
};

// The memory limit dtrain-run gives its keeper: DTRAIN_SNAPSHOT_MEMORY
// (bytes, with an optional K/M/G suffix), or half of this host's memory.
uint64_t default_memory_limit();

}  // namespace dtrain::snapshot
