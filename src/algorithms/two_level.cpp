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
// Above 4 MiB the buffer goes through the phases in chunks (up to 8, of
// 2 MiB or more), pipelined: a helper thread carries each chunk's phase 2
// while this thread runs phase 1 of the next chunks and phase 3 of those
// that are back, so the reduction inside a host overlaps the network.
//
// Each host sends 2(H-1)/H of the buffer over the network, against
// 2(n-1)/n per rank boundary on a flat ring. Results are bitwise identical
// on every rank (each block is reduced in one fixed order), but the order of
// the sum differs from a flat ring's.
//
// all_gather and reduce_scatter take the same two levels, each rank's block
// crossing between hosts once: all_gather gathers across hosts among local
// rank i's counterparts first, then the host's rows inside the host;
// reduce_scatter reduces the rows inside the host first, then across hosts.
// They work in a copy ordered by (local rank, host) - "rows" - so that every
// phase moves contiguous blocks, and copy into place at the end (or from
// place at the start). Each host sends (n-L)/n of the data over the
// network, where a flat ring sends (n-1)/n; and the L ranks of a host send
// at the same time, each on its own connections.

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <stdexcept>
#include <thread>

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

bool two_level_for(const Context& ctx, size_t total_bytes) {
  return total_bytes > kLatencyBytes && two_level_fits(ctx) &&
         (ctx.algo == AllReduceAlgo::kAuto || ctx.algo == AllReduceAlgo::kTwoLevel);
}

namespace {

// The phases' views of ctx: this rank's host, and local rank i of every host.
struct Levels {
  explicit Levels(const Context& ctx)
      : topology(*ctx.topology),
        host(topology.host_of[ctx.rank()]),
        i(topology.local_index[ctx.rank()]),
        inside_t(ctx.transport, topology.hosts[static_cast<size_t>(host)]),
        across_t(ctx.transport, counterparts(topology, i)),
        inside{inside_t, ctx.tag | kInsideHost, ctx.deadline, ctx.what,
               ctx.scratch, ctx.copy, ctx.rows},
        outside{across_t, ctx.tag | kAcrossHosts, ctx.deadline, ctx.what,
                ctx.scratch, ctx.copy, ctx.rows} {}

  static std::vector<int> counterparts(const transport::Topology& t, int i) {
    std::vector<int> ranks;
    for (const auto& h : t.hosts) ranks.push_back(h[static_cast<size_t>(i)]);
    return ranks;
  }
  int hosts() const { return static_cast<int>(topology.hosts.size()); }
  int local() const { return inside.size(); }
  // Group rank of the block at position `row` (local rank) x `h` (host).
  int rank_at(int row, int h) const {
    return topology.hosts[static_cast<size_t>(h)][static_cast<size_t>(row)];
  }

  const transport::Topology& topology;
  const int host, i;
  transport::Subset inside_t, across_t;
  const Context inside, outside;
};

}  // namespace

void two_level_all_gather(const Context& ctx, const void* input, void* output, size_t bytes) {
  const Levels lv(ctx);
  const int H = lv.hosts(), L = lv.local();
  uint8_t* rows = ctx.rows.get(bytes * ctx.size());
  uint8_t* mine = rows + static_cast<size_t>(lv.i) * H * bytes;
  const Blocks across{bytes, H * bytes}, inside{H * bytes, static_cast<size_t>(L) * H * bytes};
  // The other rows may come from a local peer while this rank is still
  // gathering its own: their receives are posted first.
  auto row_recvs = post_all_gather_recvs(lv.inside, rows, inside, lv.inside.tag);
  std::memcpy(mine + static_cast<size_t>(lv.host) * bytes, input, bytes);
  ring_all_gather(lv.outside, mine, across, lv.outside.tag,
                  post_all_gather_recvs(lv.outside, mine, across, lv.outside.tag));
  ring_all_gather(lv.inside, rows, inside, lv.inside.tag, std::move(row_recvs));
  for (int row = 0; row < L; ++row)
    for (int h = 0; h < H; ++h)
      std::memcpy(at(output, static_cast<size_t>(lv.rank_at(row, h)) * bytes),
                  rows + (static_cast<size_t>(row) * H + h) * bytes, bytes);
}

void two_level_reduce_scatter(const Context& ctx, const void* input, void* output, size_t count,
                              c10::ScalarType dtype, ReduceOp op) {
  const Levels lv(ctx);
  const int H = lv.hosts(), L = lv.local();
  const size_t bytes = count * c10::elementSize(dtype);
  uint8_t* rows = ctx.rows.get(bytes * ctx.size());
  for (int row = 0; row < L; ++row)
    for (int h = 0; h < H; ++h)
      std::memcpy(rows + (static_cast<size_t>(row) * H + h) * bytes,
                  at(input, static_cast<size_t>(lv.rank_at(row, h)) * bytes), bytes);
  // Inside: local rank i ends with row i reduced over its host; across: its
  // counterpart on host h with block (i, h) reduced over every host.
  const Blocks inside{H * bytes, static_cast<size_t>(L) * H * bytes};
  ring_reduce_scatter(lv.inside, rows, inside, dtype, op);
  uint8_t* mine = rows + static_cast<size_t>(lv.i) * H * bytes;
  ring_reduce_scatter(lv.outside, mine, Blocks{bytes, H * bytes}, dtype, op);
  std::memcpy(output, mine + static_cast<size_t>(lv.host) * bytes, bytes);
}

namespace {

// The all_reduce is cut into chunks that go through the three phases one
// after another: while chunk c crosses between hosts (on a helper thread),
// this thread reduces chunk c+1 inside the host, and it spreads chunk c
// inside the host as soon as it is back. A chunk is kChunkBytes or more.
constexpr size_t kChunkBytes = size_t{2} << 20;
constexpr size_t kMaxChunks = 8;

// The network phase of every chunk, in order, on a thread of its own: it
// starts chunk c once ready(c) says that chunk is reduced inside the host;
// crossed(c) waits until it is back (rethrowing the helper's error).
class AcrossHosts {
 public:
  AcrossHosts(size_t chunks, std::function<void(size_t)> cross)
      : ready_(chunks), crossed_(chunks), cross_(std::move(cross)) {
    for (auto& p : ready_) handed_over_.push_back(p.get_future());
    for (auto& p : crossed_) futures_.push_back(p.get_future());
    thread_ = std::thread([this] { run(); });
  }
  ~AcrossHosts() {
    // On an error of this thread: the chunks not yet handed over never will be.
    for (size_t c = handed_; c < ready_.size(); ++c)
      ready_[c].set_exception(std::make_exception_ptr(std::runtime_error("not reached")));
    thread_.join();
  }
  void ready(size_t c) {
    ready_[c].set_value();
    handed_ = c + 1;
  }
  void crossed(size_t c) { futures_[c].get(); }

 private:
  void run() {
    for (size_t c = 0; c < ready_.size(); ++c) {
      try {
        handed_over_[c].get();
        cross_(c);
        crossed_[c].set_value();
      } catch (...) {
        for (size_t k = c; k < crossed_.size(); ++k) crossed_[k].set_exception(std::current_exception());
        return;
      }
    }
  }

  std::vector<std::promise<void>> ready_, crossed_;
  std::vector<std::future<void>> handed_over_, futures_;
  std::function<void(size_t)> cross_;
  size_t handed_ = 0;
  std::thread thread_;
};

}  // namespace

void two_level_all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                          ReduceOp op) {
  Levels lv(ctx);  // not const: the helper runs over its across_t
  const int n = lv.local(), i = lv.i;
  const size_t elem = c10::elementSize(dtype), bytes = count * elem;
  const size_t chunks = std::clamp<size_t>(bytes / kChunkBytes, 1, kMaxChunks);
  const size_t chunk_count = (count + chunks - 1) / chunks;
  struct Chunk {
    uint8_t* data;
    size_t count;
    Blocks blocks;
  };
  std::vector<Chunk> parts;
  for (size_t c = 0; c < chunks; ++c) {
    const size_t first = std::min(count, c * chunk_count);
    const size_t k = std::min(count, first + chunk_count) - first;
    parts.push_back({at(data, first * elem), k, Blocks{(k + n - 1) / n * elem, k * elem}});
  }
  // As in the flat ring: the all-gathers' receives go straight into place.
  const uint64_t gather_tag = lv.inside.tag | kSecondHalf;
  std::vector<Posted> gather_recvs;
  for (const auto& part : parts)
    gather_recvs.push_back(post_all_gather_recvs(lv.inside, part.data, part.blocks, gather_tag));
  // The helper's phase has scratch of its own (rows: unused by all_reduce).
  const Context outside{lv.across_t, lv.outside.tag, ctx.deadline, ctx.what, ctx.rows, ctx.copy,
                        ctx.rows};
  auto cross = [&](size_t c) {
    const auto& part = parts[c];
    all_reduce(outside, at(part.data, part.blocks.begin(i)), part.blocks.bytes(i) / elem, dtype,
               op);
  };
  if (chunks == 1) {
    ring_reduce_scatter(lv.inside, parts[0].data, parts[0].blocks, dtype, op);
    cross(0);
    ring_all_gather(lv.inside, parts[0].data, parts[0].blocks, gather_tag,
                    std::move(gather_recvs[0]));
    return;
  }
  AcrossHosts across(chunks, cross);
  try {
    for (size_t c = 0; c < chunks; ++c) {
      ring_reduce_scatter(lv.inside, parts[c].data, parts[c].blocks, dtype, op);
      across.ready(c);
    }
    for (size_t c = 0; c < chunks; ++c) {
      across.crossed(c);
      ring_all_gather(lv.inside, parts[c].data, parts[c].blocks, gather_tag,
                      std::move(gather_recvs[c]));
    }
  } catch (...) {
    // The helper may be waiting on the network: the transport's failure
    // ends its waits before `across` joins it (the group would break the
    // transport anyway).
    ctx.transport.fail(std::current_exception());
    throw;
  }
}

}  // namespace dtrain::algorithms
