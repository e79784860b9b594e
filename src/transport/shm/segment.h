#pragma once

// A POSIX shared-memory segment shared by the ranks of one group, and the
// liveness locks that go with it (no torch here).
//
// Lifetime: group rank 0 creates the segment, every rank maps it, and as
// soon as all ranks have mapped it rank 0 unlinks the name. From then on the
// memory lives exactly as long as some rank still maps it: a crash cannot
// leak it. Only a crash of rank 0 in the short window between creating and
// unlinking leaves a name in /dev/shm; the next group created on this
// machine removes such leftovers (see remove_stale_segments).
//
// Liveness: each rank holds an open-file-description lock on byte `rank` of
// the segment's file. The kernel drops it when the rank's process dies (or
// the rank closes the segment), so a peer can tell "slow" from "gone"
// without any heartbeat thread, across PID namespaces too.

#include <cstddef>
#include <string>

namespace dtrain::shm {

// Names of our segments in /dev/shm start with this (then ".<pid>.<n>.<r>").
inline constexpr const char* kSegmentPrefix = "dtrain-shm.";

class Segment {
 public:
  // Creates a new segment of `bytes` (zero-filled) and maps it.
  static Segment create(size_t bytes);
  // Maps an existing segment; its size must be `bytes`.
  static Segment open(const std::string& name, size_t bytes);

  Segment() = default;
  // Moving leaves `other` empty (no name, no mapping). Move-assignment
  // first releases what this segment held, as the destructor does.
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();  // unmaps and closes (which drops this rank's lock)

  // Removes the name (idempotent); the mapping stays valid.
  void unlink();
  // Takes the liveness lock of `slot`; throws if someone else holds it.
  void lock_slot(int slot);
  // True while some other open description holds the lock of `slot`.
  bool slot_locked_by_other(int slot) const;
  // Drops this rank's liveness lock of `slot`: its peers then take it for
  // gone (an aborted group).
  void unlock_slot(int slot);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  // Unlinks (if still linked), unmaps and closes; leaves this empty.
  void release() noexcept;

  std::string name_;  // with the leading '/'
  int fd_ = -1;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = false;
};

// Unlinks segments in /dev/shm that a crashed creator left behind: our
// prefix, no liveness lock held by anyone, and a creator PID that no longer
// exists (or a name older than a minute). Returns how many were removed.
int remove_stale_segments();

}  // namespace dtrain::shm
