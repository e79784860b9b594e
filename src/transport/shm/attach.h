#pragma once

// Setting up one group's shared-memory segment through the store, the same
// way for the shm backend's collectives and for the shm transport (no torch
// here).

#include <cstddef>
#include <functional>
#include <string>

#include "dtrain/store/store.h"
#include "transport/shm/segment.h"

namespace dtrain::shm {

struct SegmentPlan {
  std::string what;  // "shm: setting up group 'x' (rank 1/4)", for errors
  // Rank 0: how large the segment is, and its header, written once created.
  std::function<size_t()> bytes;
  std::function<void(void* base)> init;
  // The other ranks: throws when the segment they mapped is not the one
  // this group expects (a different build, a damaged or foreign segment).
  // Its header is memory any process of this user can write.
  std::function<void(const Segment&)> check;
};

// All ranks must be on one node (node.h), else every rank throws
// BackendUnavailable naming the machines. Rank 0 creates the segment, every
// rank maps it and takes its liveness lock, and once all have, rank 0
// unlinks the name. Uses the store's keys under "shm/": give each segment
// of a group its own PrefixStore.
Segment attach_segment(Store& store, int rank, int size, const SegmentPlan& plan);

}  // namespace dtrain::shm
