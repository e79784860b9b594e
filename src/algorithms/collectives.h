#pragma once

// Collective algorithms, written once over the transport seam
// (transport/transport.h): what to compute, apart from how bytes move.
// Buffers are raw contiguous memory; element counts and dtypes matter only
// where data is reduced. Every function runs one collective to completion on
// the calling thread, under ctx.deadline; all ranks of the transport call the
// same function with the same sizes, in the same order.
//
// Results are bitwise identical on every rank and from run to run: each
// element is reduced by exactly one rank in a fixed order (ring), or by both
// partners of a pair with the lower rank's operand first (recursive
// doubling and trees), then copied.
//
// Failures propagate from the transport (see its contract): a failed
// request breaks the transport before the exception leaves here.

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

// all_reduce's algorithm (DTRAIN_ALGO): kAuto picks by size and topology.
enum class AllReduceAlgo { kAuto, kRing, kRecursiveDoubling, kTwoLevel };

// DTRAIN_ALGO's value; anything else throws InvalidArgument naming it.
AllReduceAlgo all_reduce_algo_from_env();
const char* to_string(AllReduceAlgo algo);

struct Context {
  transport::Transport& transport;
  uint64_t tag;                         // transport::collective_tag(call.seq)
  transport::Clock::time_point deadline;
  const std::string& what;              // names the call in timeouts
  Scratch& scratch;                     // the ring's receive buffers, trees' temporaries
  Scratch& copy;                        // reduce's working copy
  Scratch& rows;                        // two-level all_gather's and reduce_scatter's reordered copy
  // Where the ranks are (backend auto over several hosts); null: one flat
  // group, as far as the algorithms are concerned.
  const transport::Topology* topology = nullptr;
  AllReduceAlgo algo = AllReduceAlgo::kAuto;
  int rank() const { return transport.rank(); }
  int size() const { return transport.size(); }
};

// Marks the tag of a collective's second phase (see all_reduce).
constexpr uint64_t kSecondHalf = uint64_t{1} << 62;
// Mark the tags of the two-level all_reduce's phases inside a host and
// across hosts (two_level.cpp), each of which may use kSecondHalf too.
constexpr uint64_t kInsideHost = uint64_t{1} << 61;
constexpr uint64_t kAcrossHosts = uint64_t{1} << 60;

// Below this many bytes the latency algorithms run (recursive doubling,
// binomial trees); above it the bandwidth ones (pipelined ring and chain).
constexpr size_t kLatencyBytes = 64 * 1024;
// Large messages move in pieces of this size so that the next hop starts
// (and reductions overlap the transfer) before the whole block has arrived.
constexpr size_t kPieceBytes = 512 * 1024;

// data (count elements) becomes op over ranks, in place. AVG sums; the
// caller divides. Over several hosts with the same number of ranks each
// (ctx.topology), messages above kLatencyBytes take the two-level path
// (two_level.cpp); the others a flat ring or recursive doubling. ctx.algo
// forces one of them where it can run (two levels need such a topology, the
// ring one element per rank).
void all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype, ReduceOp op);

// Root's `bytes` reach every rank.
void broadcast(const Context& ctx, void* data, size_t bytes, int root);

// On root, data becomes op over ranks; other ranks' data is left as given.
void reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype, ReduceOp op,
            int root);

// output holds size() blocks of `bytes`; block i receives rank i's input.
void all_gather(const Context& ctx, const void* input, void* output, size_t bytes);

// Root's output receives size() blocks (others pass null).
void gather(const Context& ctx, const void* input, void* output, size_t bytes, int root);

// Root's input holds size() blocks (others pass null); block i reaches rank i.
void scatter(const Context& ctx, const void* input, void* output, size_t bytes, int root);

// input: size() blocks of `count` elements, modified (it is the ring's
// scratch); output receives op over ranks of block rank(). Each rank sends
// and receives (n-1)/n of the input's bytes.
void reduce_scatter(const Context& ctx, void* input, void* output, size_t count,
                    c10::ScalarType dtype, ReduceOp op);

// input: concatenated blocks for ranks 0..n-1 (in_bytes[i] each); output:
// concatenated blocks from ranks 0..n-1 (out_bytes[i] each).
void all_to_all(const Context& ctx, const void* input, const std::vector<size_t>& in_bytes,
                void* output, const std::vector<size_t>& out_bytes);

void barrier(const Context& ctx);

// Every rank reports to rank 0, which releases them all once each one has;
// by ctx.deadline rank 0 throws TimeoutError naming the first rank that has
// not (all_ranks: every such rank), after breaking the transport. `timeout`
// is for the message.
void monitored_barrier(const Context& ctx, std::chrono::milliseconds timeout, bool all_ranks);

}  // namespace dtrain::algorithms
