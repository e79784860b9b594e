// The one place where each collective picks its algorithm (collectives.h),
// by operation, size and topology, and DTRAIN_ALGO.
//
// Every collective runs in the shared memory of its host's slots when the
// whole group is there. Otherwise over the transport: all_reduce by
// recursive doubling up to kLatencyBytes (or below one element per rank),
// above it in two levels where the hosts allow (two_level.cpp), else a
// ring; broadcast down a binomial tree, or a pipelined chain for large
// messages of three ranks or more; reduce up a binomial tree, or for large
// messages a ring reduce-scatter gathered to root; all_gather and
// reduce_scatter by a ring, or in two levels above kLatencyBytes; gather,
// scatter and all_to_all directly between buffers. AVG is summed over the
// transport and divided once, at the end (fused into the reduction in
// shared memory).

#include <cstring>

#include "algorithms/internal.h"
#include "algorithms/reduce_kernels.h"
#include "algorithms/slots.h"
#include "common/enforce.h"
#include "common/env.h"
#include "transport/shm/slots.h"

namespace dtrain::algorithms {

const char* to_string(AllReduceAlgo algo) {
  switch (algo) {
    case AllReduceAlgo::kRing: return "ring";
    case AllReduceAlgo::kRecursiveDoubling: return "recursive_doubling";
    case AllReduceAlgo::kTwoLevel: return "two_level";
    case AllReduceAlgo::kAuto: break;
  }
  return "auto";
}

AllReduceAlgo all_reduce_algo_from_env() {
  const std::string value = env::get(env::kAlgo).value_or("auto");
  for (auto algo : {AllReduceAlgo::kAuto, AllReduceAlgo::kRing,
                    AllReduceAlgo::kRecursiveDoubling, AllReduceAlgo::kTwoLevel})
    if (value == to_string(algo)) return algo;
  throw InvalidArgument(detail::cat("environment variable ", env::kAlgo.name, "='", value,
                                    "' is not valid (expected auto, ring, recursive_doubling or "
                                    "two_level)"));
}

namespace {

// The whole group shares one host's slots: the shared-memory collectives.
bool in_shared_memory(const Context& ctx) {
  return ctx.slots != nullptr && ctx.slots->size() == ctx.size();
}

slots::Call slots_call(const Context& ctx) {
  return slots::Call{*ctx.slots, ctx.what, ctx.seq, ctx.op, ctx.deadline};
}

// Whether all_gather and reduce_scatter of `total_bytes` (the whole
// output, resp. input) take two levels: a topology that fits, above
// kLatencyBytes, unless DTRAIN_ALGO forces a flat algorithm.
bool two_level_for(const Context& ctx, size_t total_bytes) {
  return total_bytes > kLatencyBytes && two_level_fits(ctx) &&
         (ctx.algo == AllReduceAlgo::kAuto || ctx.algo == AllReduceAlgo::kTwoLevel);
}

// A mismatch that the slots find inside one host of a two-level collective
// is not seen on the other hosts, whose ranks wait for this host's network
// phase: it breaks the group, where slots::Mismatch would leave it usable.
template <typename Fn>
void two_level(Fn&& fn) {
  try {
    fn();
  } catch (const slots::Mismatch& e) {
    throw CollectiveMismatch(e.what());
  }
}

// The reductions over the transport sum for AVG; the result is divided once.
ReduceOp summed(ReduceOp op) { return op == ReduceOp::AVG ? ReduceOp::SUM : op; }

void average(const Context& ctx, ReduceOp op, void* data, size_t count, c10::ScalarType dtype) {
  if (op == ReduceOp::AVG) kernels::divide_by(dtype, data, count, ctx.size());
}

// `n` blocks of `bytes` one after another from pointers[0]: a flat buffer
// the algorithms can use in place.
template <typename P>
bool contiguous(const std::vector<P>& pointers, size_t bytes) {
  for (size_t j = 1; j < pointers.size(); ++j)
    if (at(pointers[0], j * bytes) != pointers[j]) return false;
  return true;
}

AllReduceAlgo all_reduce_algo(const Context& ctx, size_t count, size_t bytes) {
  const bool ring_fits = count >= static_cast<size_t>(ctx.size());
  auto algo = ctx.algo;
  if ((algo == AllReduceAlgo::kRing && !ring_fits) ||
      (algo == AllReduceAlgo::kTwoLevel && !two_level_fits(ctx)))
    algo = AllReduceAlgo::kAuto;
  if (algo != AllReduceAlgo::kAuto) return algo;
  if (bytes <= kLatencyBytes || !ring_fits) return AllReduceAlgo::kRecursiveDoubling;
  if (two_level_fits(ctx)) return AllReduceAlgo::kTwoLevel;
  return AllReduceAlgo::kRing;
}

}  // namespace

void all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                ReduceOp op) {
  if (ctx.size() == 1 || count == 0) return;
  if (in_shared_memory(ctx)) return slots::all_reduce(slots_call(ctx), data, count, dtype, op);
  const size_t bytes = count * c10::elementSize(dtype);
  switch (all_reduce_algo(ctx, count, bytes)) {
    case AllReduceAlgo::kTwoLevel:
      two_level([&] { two_level_all_reduce(ctx, data, count, dtype, summed(op)); });
      break;
    case AllReduceAlgo::kRing: ring_all_reduce(ctx, data, count, dtype, summed(op)); break;
    default: recursive_doubling_all_reduce(ctx, data, count, dtype, summed(op)); break;
  }
  average(ctx, op, data, count, dtype);
}

void broadcast(const Context& ctx, void* data, size_t count, c10::ScalarType dtype, int root) {
  if (ctx.size() == 1) return;
  if (in_shared_memory(ctx)) return slots::broadcast(slots_call(ctx), data, count, dtype, root);
  const size_t bytes = count * c10::elementSize(dtype);
  if (bytes == 0) return;
  if (bytes <= kLatencyBytes || ctx.size() == 2)
    binomial_broadcast(ctx, data, bytes, root);  // with two ranks both are one hop
  else
    chain_broadcast(ctx, data, bytes, root);
}

void reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype, ReduceOp op,
            int root) {
  if (ctx.size() == 1) return average(ctx, op, data, count, dtype);
  if (in_shared_memory(ctx))
    return slots::reduce(slots_call(ctx), data, count, dtype, op, root);
  if (count == 0) return;
  const size_t bytes = count * c10::elementSize(dtype);
  if (bytes <= kLatencyBytes || count < static_cast<size_t>(ctx.size()))
    binomial_reduce(ctx, data, count, dtype, summed(op), root);
  else
    ring_reduce(ctx, data, count, dtype, summed(op), root);
  if (ctx.rank() == root) average(ctx, op, data, count, dtype);
}

void all_gather(const Context& ctx, const void* input, size_t count, c10::ScalarType dtype,
                const std::vector<void*>& outputs) {
  const size_t bytes = count * c10::elementSize(dtype);
  if (ctx.size() == 1) {
    if (bytes && outputs[0] != input) std::memcpy(outputs[0], input, bytes);
    return;
  }
  if (in_shared_memory(ctx))
    return slots::gather(slots_call(ctx), outputs, input, count, dtype, -1);
  // Rows of one flat output are used in place; a list is staged.
  const bool flat = contiguous(outputs, bytes);
  uint8_t* out = flat ? static_cast<uint8_t*>(outputs[0]) : ctx.copy.get(bytes * ctx.size());
  if (two_level_for(ctx, bytes * ctx.size()))
    two_level([&] { two_level_all_gather(ctx, input, out, bytes); });
  else
    ring_all_gather_into(ctx, input, out, bytes);
  if (!flat)
    for (int j = 0; j < ctx.size(); ++j)
      if (bytes) std::memcpy(outputs[j], out + j * bytes, bytes);
}

void gather(const Context& ctx, const void* input, size_t count, c10::ScalarType dtype,
            const std::vector<void*>& outputs, int root) {
  if (ctx.size() > 1 && in_shared_memory(ctx))
    return slots::gather(slots_call(ctx), outputs, input, count, dtype, root);
  direct_gather(ctx, input, count * c10::elementSize(dtype), outputs, root);
}

void scatter(const Context& ctx, const std::vector<const void*>& inputs, void* output,
             size_t count, c10::ScalarType dtype, int root) {
  if (ctx.size() > 1 && in_shared_memory(ctx))
    return slots::scatter(slots_call(ctx), output, inputs, count, dtype, root);
  direct_scatter(ctx, inputs, output, count * c10::elementSize(dtype), root);
}

void reduce_scatter(const Context& ctx, const std::vector<const void*>& inputs, void* output,
                    size_t count, c10::ScalarType dtype, ReduceOp op) {
  const size_t bytes = count * c10::elementSize(dtype);
  if (ctx.size() == 1) {
    if (bytes && output != inputs[0]) std::memcpy(output, inputs[0], bytes);
    return;
  }
  if (in_shared_memory(ctx))
    return slots::reduce_scatter(slots_call(ctx), output, inputs, count, dtype, op);
  const size_t total = bytes * ctx.size();
  if (two_level_for(ctx, total) && contiguous(inputs, bytes)) {
    two_level([&] { two_level_reduce_scatter(ctx, inputs[0], output, count, dtype, summed(op)); });
  } else {
    // The ring reduces in place: the inputs are copied into a working buffer.
    uint8_t* work = ctx.copy.get(total);
    for (int j = 0; j < ctx.size(); ++j)
      if (bytes) std::memcpy(work + j * bytes, inputs[j], bytes);
    if (two_level_for(ctx, total))
      two_level([&] { two_level_reduce_scatter(ctx, work, output, count, dtype, summed(op)); });
    else
      ring_reduce_scatter_from(ctx, work, output, count, dtype, summed(op));
  }
  average(ctx, op, output, count, dtype);
}

void all_to_all(const Context& ctx, const std::vector<const void*>& inputs,
                const std::vector<size_t>& in_bytes, const std::vector<void*>& outputs,
                const std::vector<size_t>& out_bytes, c10::ScalarType dtype) {
  if (ctx.size() > 1 && in_shared_memory(ctx))
    return slots::all_to_all(slots_call(ctx), outputs, out_bytes, inputs, in_bytes, dtype);
  direct_all_to_all(ctx, inputs, in_bytes, outputs, out_bytes);
}

void barrier(const Context& ctx) {
  if (ctx.size() == 1) return;
  if (in_shared_memory(ctx)) return slots::barrier(slots_call(ctx));
  dissemination_barrier(ctx);
}

}  // namespace dtrain::algorithms
