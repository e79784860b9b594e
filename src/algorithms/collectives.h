#pragma once

// Collective algorithms: what to compute, apart from how bytes move. What a
// backend calls (backends/engine/): one function per collective, each
// picking its algorithm in one place (select.cpp) by operation, size and
// topology:
//  - the in-place shared-memory collectives (slots.h) when every rank of
//    the group shares one host's slots;
//  - otherwise algorithms written once over the transport seam
//    (transport/transport.h): recursive doubling and binomial trees for
//    small messages, pipelined rings and chains for large ones, direct
//    exchanges for gather, scatter and all_to_all (internal.h);
//  - over several hosts with as many ranks each, the two-level all_reduce,
//    all_gather and reduce_scatter (two_level.cpp), whose phases inside a
//    host run in the host's shared memory where it has slots.
// Buffers are raw memory; element counts and dtypes matter where data is
// reduced, and for the shared-memory collectives' check that every rank
// called the same thing. Every function runs one collective to completion
// on the calling thread, under ctx.deadline; all ranks call the same
// function with the same sizes, in the same order.
//
// Results are bitwise identical on every rank and from run to run: each
// element is reduced by exactly one rank in a fixed order (ring, shared
// memory), or by both partners of a pair with the lower rank's operand
// first (recursive doubling and trees), then copied.
//
// Failures propagate from the transport (see its contract): a failed
// request breaks the transport before the exception leaves here. The
// shared-memory collectives raise a mismatch of the ranks' calls on every
// rank at the same step instead (slots.h), which leaves the group usable.

#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/process_group.h"
#include "transport/topology.h"
#include "transport/transport.h"

namespace dtrain::shm {
class Slots;
}

namespace dtrain::algorithms {

// Scratch memory owned by the group and reused from call to call: a fresh
// allocation of tens of MiB is mapped and page-faulted in anew every time
// (glibc serves blocks over 32 MiB with mmap), which costs more than the
// transfer on a loaded machine. Grows, never shrinks; one thread at a time.
class Scratch {
 public:
  uint8_t* get(size_t bytes) {
    if (bytes > size_) {
      data_.reset(new uint8_t[bytes]);
      size_ = bytes;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
};

// all_reduce's algorithm over the transport (DTRAIN_ALGO): kAuto picks by
// size and topology. Where the whole group shares slots, the shared-memory
// all_reduce runs whatever it says.
enum class AllReduceAlgo { kAuto, kRing, kRecursiveDoubling, kTwoLevel };

// DTRAIN_ALGO's value; anything else throws InvalidArgument naming it.
AllReduceAlgo all_reduce_algo_from_env();
const char* to_string(AllReduceAlgo algo);

struct Context {
  transport::Transport& transport;
  uint64_t tag;                         // transport::collective_tag(seq)
  transport::Clock::time_point deadline;
  const std::string& what;              // names the call in timeouts
  Scratch& scratch;                     // the ring's receive buffers, trees' temporaries
  Scratch& copy;                        // reduce's working copy, staging of lists
  Scratch& rows;                        // two-level all_gather's and reduce_scatter's reordered copy
  // Where the ranks are; null: one flat group, as far as the algorithms
  // are concerned.
  const transport::Topology* topology = nullptr;
  AllReduceAlgo algo = AllReduceAlgo::kAuto;
  // This rank's host's slots (transport/fabric.h), its ranks in topology
  // order; null: none.
  shm::Slots* slots = nullptr;
  uint64_t seq = 0;                     // the call's number in its group
  const char* op = "";                  // "all_reduce", ...: what the slots stamp
  int rank() const { return transport.rank(); }
  int size() const { return transport.size(); }
};

// data (count elements) becomes op over ranks, in place; AVG divides the
// sum by size() (truncating for integers).
void all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype, ReduceOp op);

// Root's data reaches every rank.
void broadcast(const Context& ctx, void* data, size_t count, c10::ScalarType dtype, int root);

// On root, data becomes op over ranks (AVG as all_reduce's); other ranks'
// data is left as given.
void reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype, ReduceOp op,
            int root);

// outputs[j] (size() of them, count elements each) receives rank j's input.
void all_gather(const Context& ctx, const void* input, size_t count, c10::ScalarType dtype,
                const std::vector<void*>& outputs);

// The same on root only; other ranks pass no outputs.
void gather(const Context& ctx, const void* input, size_t count, c10::ScalarType dtype,
            const std::vector<void*>& outputs, int root);

// Root's inputs[j] reaches rank j's output; other ranks pass no inputs.
void scatter(const Context& ctx, const std::vector<const void*>& inputs, void* output,
             size_t count, c10::ScalarType dtype, int root);

// output becomes op over ranks of their inputs[rank()] (size() inputs of
// count elements; AVG as all_reduce's). Inputs are not modified; output may
// be inputs[rank()] itself (in place).
void reduce_scatter(const Context& ctx, const std::vector<const void*>& inputs, void* output,
                    size_t count, c10::ScalarType dtype, ReduceOp op);

// outputs[j] (out_bytes[j]) receives rank j's inputs[rank()] (in_bytes).
void all_to_all(const Context& ctx, const std::vector<const void*>& inputs,
                const std::vector<size_t>& in_bytes, const std::vector<void*>& outputs,
                const std::vector<size_t>& out_bytes, c10::ScalarType dtype);

void barrier(const Context& ctx);

// Every rank reports to rank 0, which releases them all once each one has;
// by ctx.deadline rank 0 throws TimeoutError naming the first rank that has
// not (all_ranks: every such rank), after breaking the transport. `timeout`
// is for the message.
void monitored_barrier(const Context& ctx, std::chrono::milliseconds timeout, bool all_ranks);

}  // namespace dtrain::algorithms
