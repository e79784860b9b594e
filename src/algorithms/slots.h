#pragma once

// Collectives over the slots of one host's ranks (transport/shm/slots.h,
// mapped by the fabric): the copy-free path between the ranks of one
// machine, for a whole group on one host and for the inside-host phases of
// the two-level algorithms. A rank reads its peers'
// data in place in their slots instead of receiving copies of it.
//
// all_reduce is a reduce-scatter followed by an all-gather through the
// slots: each rank copies in the parts of its piece that others reduce,
// reduces its own part straight from its buffer, and copies the others'
// results out; pipelined, so that while piece k is reduced piece k+1 is
// already copied in. A small one (64 KiB read by each rank at most, its
// data times the ranks) takes one barrier instead of two: every rank
// copies its data in whole and reduces all the copies itself, in the same
// order, so the bits are the same. Ranks step through pieces with the
// phase barrier (spin, then futex; dead-peer aware).
//
// Every collective first checks, at its first barrier and at no extra
// synchronization, that all ranks called the same operation on the same
// sizes and dtype: a mismatch throws Mismatch on every rank at the same
// step, which leaves the group usable. A timeout or a dead peer throws
// TimeoutError or NetworkError from the barrier.

#include <c10/core/ScalarType.h>

#include <chrono>
#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/process_group.h"
#include "transport/shm/slots.h"

namespace dtrain::algorithms::slots {

// One collective on the slots.
struct Call {
  shm::Slots& slots;
  const std::string& what;  // "all_reduce #3 on group ..."
  uint64_t seq;
  const char* op;           // "all_reduce", for the stamp
  std::chrono::steady_clock::time_point deadline;
};

// Raised by every rank at the same step, before any data moved: the ranks
// are still in step and the group goes on. Mismatch: ranks called
// different collectives; SizeMismatch: all_to_all's sizes do not pair up.
class Mismatch : public CollectiveMismatch {
 public:
  using CollectiveMismatch::CollectiveMismatch;
};
class SizeMismatch : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

// data (count elements) becomes op over ranks, in place (AVG sums).
void all_reduce(const Call& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op);
// On root, data becomes op over ranks; the others' data is left as given.
void reduce(const Call& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op,
            int root);
void broadcast(const Call& c, void* data, size_t count, c10::ScalarType dtype, int root);
// outputs[j] receives rank j's input on root (root -1: on every rank, an
// all_gather); other ranks pass no outputs.
void gather(const Call& c, const std::vector<void*>& outputs, const void* input, size_t count,
            c10::ScalarType dtype, int root);
// Root's inputs[j] reaches rank j's output; other ranks pass no inputs.
void scatter(const Call& c, void* output, const std::vector<const void*>& inputs, size_t count,
             c10::ScalarType dtype, int root);
// output becomes op over ranks of their inputs[rank()]; output may be
// inputs[rank()] itself (in place).
void reduce_scatter(const Call& c, void* output, const std::vector<const void*>& inputs,
                    size_t count, c10::ScalarType dtype, ReduceOp op);
// outputs[j] (out_bytes[j]) receives rank j's inputs[rank()]; a pair of
// sizes that do not match is a SizeMismatch on every rank.
void all_to_all(const Call& c, const std::vector<void*>& outputs,
                const std::vector<size_t>& out_bytes, const std::vector<const void*>& inputs,
                const std::vector<size_t>& in_bytes, c10::ScalarType dtype);
void barrier(const Call& c);

// The inside-host phases of the two-level collectives (two_level.cpp):
// data holds size() blocks of `stride` elements (the last ones shorter or
// empty: `count` in all), the same on every rank of the slots.
// reduce_scatter_blocks leaves block rank() of data reduced over the ranks
// (AVG sums), in place; all_gather_blocks copies each rank's block rank()
// into the others' data.
void reduce_scatter_blocks(const Call& c, void* data, size_t stride, size_t count,
                           c10::ScalarType dtype, ReduceOp op);
void all_gather_blocks(const Call& c, void* data, size_t stride, size_t count,
                       c10::ScalarType dtype);

}  // namespace dtrain::algorithms::slots
