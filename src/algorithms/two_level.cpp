// The two-level all_reduce, for a group over several hosts with L ranks on
// each (backend auto): the pairs inside a host are joined by shared-memory
// rings, the pairs across hosts by TCP.
//
//  1. Inside each host, a ring reduce-scatter over the host's L ranks: local
//     rank i ends with block i (1/L of the buffer) reduced over its host.
//  2. Across hosts, local rank i of every host all-reduces its block i with
//     the others (ring or recursive doubling, as a flat group of H ranks
//     would). The L blocks cross between hosts at the same time, each on
//     its own rank's connections, so all of a host's cores and TCP streams
//     carry the network phase, not one leader's.
//  3. Inside each host, a ring all-gather spreads the L blocks.
//
// Each host sends 2(H-1)/H of the buffer over the network, against
// 2(n-1)/n per rank boundary on a flat ring. Results are bitwise identical
// on every rank (each block is reduced in one fixed order), but the order of
// the sum differs from a flat ring's.

#include <c10/core/ScalarType.h>

#include "algorithms/util.h"
#include "transport/subset.h"

namespace dtrain::algorithms {

bool two_level_fits(const Context& ctx) {
  const auto* topology = ctx.topology;
  if (!topology) return false;
  const size_t hosts = topology->hosts.size();
  // One host, or one rank per host: the flat algorithms are the same thing.
  return hosts > 1 && hosts < static_cast<size_t>(ctx.size()) && topology->uniform();
}

void two_level_all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                          ReduceOp op) {
  const auto& topology = *ctx.topology;
  const int me = ctx.rank();
  const auto& local = topology.hosts[topology.host_of[me]];
  const int i = topology.local_index[me];
  std::vector<int> across;  // local rank i of every host
  for (const auto& host : topology.hosts) across.push_back(host[i]);

  transport::Subset inside_t(ctx.transport, local), across_t(ctx.transport, std::move(across));
  const Context inside{inside_t, ctx.tag | kInsideHost, ctx.deadline, ctx.what, ctx.scratch,
                       ctx.copy};
  const Context outside{across_t, ctx.tag | kAcrossHosts, ctx.deadline, ctx.what, ctx.scratch,
                        ctx.copy};

  const int n = inside.size();
  const size_t elem = c10::elementSize(dtype), bytes = count * elem;
  const Blocks blocks{(count + n - 1) / n * elem, bytes};
  // As in the flat ring: the all-gather's receives go straight into place.
  const uint64_t gather_tag = inside.tag | kSecondHalf;
  auto gather_recvs = post_all_gather_recvs(inside, data, blocks, gather_tag);
  ring_reduce_scatter(inside, data, blocks, dtype, op);
  all_reduce(outside, at(data, blocks.begin(i)), blocks.bytes(i) / elem, dtype, op);
  ring_all_gather(inside, data, blocks, gather_tag, std::move(gather_recvs));
}

}  // namespace dtrain::algorithms
