#pragma once

// Setting up one group's shared-memory segment through the store, the same
// way for the shm backend's collectives and for the shm transport (no torch
// here).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "dtrain/store/store.h"
#include "transport/shm/segment.h"

namespace dtrain::shm {

// The first bytes of every segment: its kind and layout version, the group
// size, and the bytes of each of its parts (a ring, a slot half). Rank 0
// writes it; the others check it before anything is placed by it, since it
// is memory any process of this user can write.
struct alignas(64) SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t part_bytes;
};

struct SegmentPlan {
  std::string what;  // "shm: setting up group 'x' (rank 1/4)", for errors
  const char* kind = "";   // "a ring segment", for errors
  const char* parts = "";  // "rings", for errors
  uint64_t magic = 0;
  uint32_t version = 0;
  // Rank 0: the bytes of each part, which the header records.
  std::function<size_t()> part_bytes;
  // Every rank: the segment's size for parts of that many bytes.
  std::function<size_t(size_t part_bytes)> total_bytes;
  // The other ranks: whether a part size read from the header is one this
  // group can have (asked before total_bytes).
  std::function<bool(uint64_t part_bytes)> part_bytes_valid;
};

// The header of a segment that attach_segment returned.
inline const SegmentHeader& header_of(const Segment& segment) {
  return *static_cast<const SegmentHeader*>(segment.data());
}

// All ranks must be on one node (node.h), else every rank throws
// BackendUnavailable naming the machines. Rank 0 creates the segment, every
// rank maps it and takes its liveness lock, and once all have, rank 0
// unlinks the name. Uses the store's keys under "shm/": give each segment
// of a group its own PrefixStore.
Segment attach_segment(Store& store, int rank, int size, const SegmentPlan& plan);

}  // namespace dtrain::shm
