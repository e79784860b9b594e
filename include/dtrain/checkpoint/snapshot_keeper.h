#pragma once

// torch-free: a launcher includes it without torch's headers.

#include <cstdint>
#include <memory>
#include <string>

namespace dtrain::checkpoint {

// The memory that holds a host's snapshots outside its workers. dtrain-run
// runs one per host and gives its workers the socket; a launcher of your
// own can do the same: keep one alive per host for the job's lifetime and
// set DTRAIN_SNAPSHOT_SOCKET=socket_path() for the workers it starts (or
// pass it as SnapshotOptions::keeper_socket). It listens on a Unix socket
// in a new directory of its own (mode 0700) under `parent_dir` ("": /tmp)
// and holds at most `memory_limit` bytes: its newest complete snapshot and
// the one being written. Destroying it frees them and removes the socket.
// Throws dtrain::Error when it cannot listen.
class SnapshotKeeper {
 public:
  explicit SnapshotKeeper(uint64_t memory_limit = default_memory_limit(), const std::string& parent_dir = "");
  ~SnapshotKeeper();
  SnapshotKeeper(const SnapshotKeeper&) = delete;
  SnapshotKeeper& operator=(const SnapshotKeeper&) = delete;
  const std::string& socket_path() const;
  uint64_t bytes_held() const;
  // DTRAIN_SNAPSHOT_MEMORY (InvalidArgument naming it when malformed), or
  // half of this host's memory.
  static uint64_t default_memory_limit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::checkpoint
