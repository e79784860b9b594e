#pragma once

// The shm transport's copy-free capability (Transport::shared_slots()): one
// shared-memory segment per group in which every rank owns a slot, split in
// two halves that successive pieces of a collective alternate between, plus
// per-rank phase counters (phase_barrier.h), a stamp per rank and
// collective (what it called: checked at the first barrier, so mismatched
// calls are caught at no extra synchronization), and tables for
// all_to_all's byte counts. The algorithms over them are
// algorithms/slots.cpp; they read peers' data in place instead of
// receiving copies of it. No torch here.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/store/store.h"
#include "transport/shm/phase_barrier.h"
#include "transport/shm/segment.h"

namespace dtrain::shm {

class Slots {
 public:
  static constexpr size_t kLine = 64;
  static constexpr size_t kStampBytes = 2 * kLine;

  // Every rank of the group; uses the store's keys under "shm/" (give it a
  // scope of its own). DTRAIN_SHM_CHUNK_BYTES, read by rank 0, sizes the
  // slot halves (chunk_bytes). `name`: the group's, for messages.
  Slots(Store& store, int rank, int size, const std::string& name);
  Slots(const Slots&) = delete;  // the barrier refers to the segment
  Slots& operator=(const Slots&) = delete;

  // The slot halves of a group of `ranks` as DTRAIN_SHM_CHUNK_BYTES says:
  // its value, or for "auto" (the default) 1 MiB, less above 4 ranks so that
  // the slots take at most 8 MiB, and at least 128 KiB.
  static size_t chunk_bytes(int ranks);

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t half_bytes() const { return half_bytes_; }
  uint8_t* slot(int rank, int half) const {
    return data_ + (static_cast<size_t>(rank) * 2 + half) * half_bytes_;
  }
  // Rank r's stamp for the collective numbered `index` (two in turn).
  void* stamp(int rank, uint64_t index) const {
    return stamps_ + (2 * static_cast<size_t>(rank) + index % 2) * kStampBytes;
  }
  // all_to_all's [from][to] sends and [at][from] expectations, n*n each.
  int64_t* exchange_table(uint64_t index) const {
    const size_t n = size_;
    return tables_ + (index % 2) * 2 * n * n;
  }
  PhaseBarrier& barrier() { return *barrier_; }
  // The group was aborted: a wait in the barrier fails with `why`, and this
  // rank's slot is let go, so that its peers' waits fail too.
  void abort(const std::string& why);
  const Segment& segment() const { return segment_; }

  // Where the ranks are in the sequence of collectives, the same on every
  // rank: pieces moved so far (which half comes next) and collectives run
  // (which stamp and table slot).
  uint64_t pieces = 0;
  uint64_t collectives_run = 0;

 private:
  void attach(Store& store, const std::string& name);

  int rank_, size_;
  Segment segment_;
  size_t half_bytes_ = 0;
  PhaseCounter* counters_ = nullptr;
  uint8_t* stamps_ = nullptr;
  int64_t* tables_ = nullptr;
  uint8_t* data_ = nullptr;
  std::unique_ptr<PhaseBarrier> barrier_;
};

}  // namespace dtrain::shm
