// The two-level all_reduce, for a group over several hosts with L ranks on
// each (backend auto): the pairs inside a host share memory, the pairs
// across hosts are joined by TCP.
//
//  1. Inside each host, a reduce-scatter over the host's L ranks: local
//     rank i ends with block i (1/L of the buffer) reduced over its host.
//  2. Across hosts, local rank i of every host all-reduces its block i with
//     the others (ring or recursive doubling, as a flat group of H ranks
//     would). The L blocks cross between hosts at the same time, each on
//     its own rank's connections, so all of a host's cores and TCP streams
//     carry the network phase, not one leader's.
//  3. Inside each host, an all-gather spreads the L blocks.
//
// The phases inside a host run in its slots where the fabric mapped them
// (slots.h: each rank reads its peers' parts in place, one copy where the
// rings take two and an I/O thread), else as rings over the transport.
//
// From 8 MiB the buffer goes through the phases in chunks (2 to 8, of 4 MiB
// or more), pipelined on this one thread: each chunk's phase 2 is
// posted as soon as its phase 1 is done and moves on (CrossingRing::poll)
// between the next chunks' phases, its bytes carried meanwhile by the
// transport's I/O threads; so the reduction inside a host overlaps the
// network.
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
#include <memory>

#include "algorithms/reduce_kernels.h"
#include "algorithms/internal.h"
#include "algorithms/slots.h"
#include "transport/subset.h"

namespace dtrain::algorithms {

bool two_level_fits(const Context& ctx) {
  const auto* topology = ctx.topology;
  if (!topology) return false;
  const size_t hosts = topology->hosts.size();
  // One host, or one rank per host: the flat algorithms are the same thing.
  return hosts > 1 && hosts < static_cast<size_t>(ctx.size()) && topology->uniform();
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

// The phases inside the host, over `data`: blocks.stride and total of the
// L blocks, in bytes. In the host's slots when there are (the receives the
// ring posts ahead are then not used), else the rings over the transport.
void inside_reduce_scatter(const Context& ctx, const Levels& lv, void* data, const Blocks& blocks,
                           c10::ScalarType dtype, ReduceOp op) {
  if (!ctx.slots) return ring_reduce_scatter(lv.inside, data, blocks, dtype, op);
  const size_t elem = c10::elementSize(dtype);
  slots::reduce_scatter_blocks(slots::Call{*ctx.slots, ctx.what, ctx.seq, ctx.op, ctx.deadline},
                               data, blocks.stride / elem, blocks.total / elem, dtype, op);
}

void inside_all_gather(const Context& ctx, const Levels& lv, void* data, const Blocks& blocks,
                       uint64_t tag, Posted recvs) {
  if (!ctx.slots) return ring_all_gather(lv.inside, data, blocks, tag, std::move(recvs));
  slots::all_gather_blocks(slots::Call{*ctx.slots, ctx.what, ctx.seq, ctx.op, ctx.deadline},
                           data, blocks.stride, blocks.total, c10::ScalarType::Byte);
}

Posted post_inside_recvs(const Context& ctx, const Levels& lv, void* data, const Blocks& blocks,
                         uint64_t tag) {
  return ctx.slots ? Posted{} : post_all_gather_recvs(lv.inside, data, blocks, tag);
}

}  // namespace

void two_level_all_gather(const Context& ctx, const void* input, void* output, size_t bytes) {
  const Levels lv(ctx);
  const int H = lv.hosts(), L = lv.local();
  uint8_t* rows = ctx.rows.get(bytes * ctx.size());
  uint8_t* mine = rows + static_cast<size_t>(lv.i) * H * bytes;
  const Blocks across{bytes, H * bytes}, inside{H * bytes, static_cast<size_t>(L) * H * bytes};
  // The other rows may come from a local peer while this rank is still
  // gathering its own: their receives are posted first.
  auto row_recvs = post_inside_recvs(ctx, lv, rows, inside, lv.inside.tag);
  std::memcpy(mine + static_cast<size_t>(lv.host) * bytes, input, bytes);
  ring_all_gather(lv.outside, mine, across, lv.outside.tag,
                  post_all_gather_recvs(lv.outside, mine, across, lv.outside.tag));
  inside_all_gather(ctx, lv, rows, inside, lv.inside.tag, std::move(row_recvs));
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
  inside_reduce_scatter(ctx, lv, rows, inside, dtype, op);
  uint8_t* mine = rows + static_cast<size_t>(lv.i) * H * bytes;
  ring_reduce_scatter(lv.outside, mine, Blocks{bytes, H * bytes}, dtype, op);
  std::memcpy(output, mine + static_cast<size_t>(lv.host) * bytes, bytes);
}

namespace {

// The all_reduce is cut into chunks that go through the three phases one
// after another: while chunk c crosses between hosts, this thread reduces
// chunk c+1 inside the host, and it spreads chunk c inside the host once it
// is back. A chunk is kChunkBytes or more.
constexpr size_t kChunkBytes = size_t{4} << 20;
constexpr size_t kMaxChunks = 8;

// Chunk c's network phase: a ring all_reduce among the H counterparts
// (H-1 reduce-scatter steps, then H-1 all-gather steps), a whole block per
// step, that advances without blocking: poll() takes it as far as the data
// that has arrived allows, so that this thread can go on with the phases
// inside the host meanwhile. Its messages carry a tag of their own, so the
// chunks in flight never take each other's. Each block is reduced by one
// rank in ring order, as in the flat ring: the results are bitwise equal on
// every rank.
class CrossingRing {
 public:
  CrossingRing(const Context& across, uint64_t tag, uint8_t* data, size_t count,
               c10::ScalarType dtype, ReduceOp op, uint8_t* scratch)
      : ctx_(across), tag_(tag), data_(data), dtype_(dtype), op_(op), scratch_(scratch),
        n_(across.size()), r_(across.rank()),
        blocks_{(count + n_ - 1) / n_ * c10::elementSize(dtype), count * c10::elementSize(dtype)} {
    post_step();
  }

  // Moves on while the current step's block has arrived; true once done.
  bool poll() {
    while (step_ < steps()) {
      if (recv_ && !recv_->done()) return false;
      finish_step();
    }
    return true;
  }

  // Blocks until done (each step's receive under the deadline).
  void finish() {
    while (step_ < steps()) {
      if (recv_) recv_->wait(ctx_.deadline, ctx_.what);
      finish_step();
    }
    wait_all(ctx_, sends_);
  }

 private:
  int steps() const { return 2 * (n_ - 1); }
  bool gathering() const { return step_ >= n_ - 1; }
  // Step s of the reduce-scatter sends block r-s-1 (reduced at step s-1)
  // and receives block r-s-2 to reduce; step t of the all-gather sends block
  // r-t (complete) and receives block r-t-1 into place.
  int send_block() const {
    return gathering() ? mod(r_ - (step_ - n_ + 1), n_) : mod(r_ - step_ - 1, n_);
  }
  int recv_block() const { return mod(send_block() - 1, n_); }

  void post_step() {
    recv_.reset();
    if (step_ >= steps()) return;
    const int out = send_block(), in = recv_block();
    auto& t = ctx_.transport;
    if (blocks_.bytes(out))
      sends_.push_back(t.isend(mod(r_ + 1, n_), tag_, at(data_, blocks_.begin(out)),
                               blocks_.bytes(out)));
    if (blocks_.bytes(in))
      recv_ = t.irecv(mod(r_ - 1, n_), tag_,
                      gathering() ? at(data_, blocks_.begin(in)) : scratch_, blocks_.bytes(in));
  }

  void finish_step() {
    if (recv_) {
      recv_->wait(ctx_.deadline, ctx_.what);  // done: returns, or throws its error
      if (!gathering()) {
        const int b = recv_block();
        kernels::accumulate_into(dtype_, op_, at(data_, blocks_.begin(b)), scratch_,
                                 blocks_.bytes(b) / c10::elementSize(dtype_));
      }
    }
    ++step_;
    post_step();
  }

  const Context& ctx_;
  const uint64_t tag_;
  uint8_t* const data_;
  const c10::ScalarType dtype_;
  const ReduceOp op_;
  uint8_t* const scratch_;
  const int n_, r_;
  const Blocks blocks_;
  int step_ = 0;
  transport::RequestPtr recv_;
  std::vector<transport::RequestPtr> sends_;
};

}  // namespace

void two_level_all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                          ReduceOp op) {
  Levels lv(ctx);  // not const: the crossing runs over its across_t
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
    gather_recvs.push_back(post_inside_recvs(ctx, lv, part.data, part.blocks, gather_tag));
  const Context outside{lv.across_t, lv.outside.tag, ctx.deadline, ctx.what, ctx.scratch,
                        ctx.copy, ctx.rows};
  if (chunks == 1) {
    inside_reduce_scatter(ctx, lv, parts[0].data, parts[0].blocks, dtype, op);
    const auto& b = parts[0].blocks;
    all_reduce(outside, at(parts[0].data, b.begin(i)), b.bytes(i) / elem, dtype, op);
    inside_all_gather(ctx, lv, parts[0].data, parts[0].blocks, gather_tag,
                      std::move(gather_recvs[0]));
    return;
  }
  // Each chunk's crossing receives into a scratch block of its own (rows:
  // the ring inside the host uses `scratch`). Chunk c's tag has c in bits
  // 52-55 (sequence numbers stay far below).
  const size_t widest = parts[0].blocks.stride / elem;  // elements of the widest block
  const size_t across_stride = (widest + lv.hosts() - 1) / lv.hosts() * elem;
  uint8_t* crossing_scratch = ctx.rows.get(chunks * across_stride);
  std::vector<std::unique_ptr<CrossingRing>> crossing;
  auto progress = [&] {
    for (auto& x : crossing) x->poll();
  };
  for (size_t c = 0; c < chunks; ++c) {
    inside_reduce_scatter(ctx, lv, parts[c].data, parts[c].blocks, dtype, op);
    const auto& b = parts[c].blocks;
    crossing.push_back(std::make_unique<CrossingRing>(
        outside, outside.tag | (uint64_t{c} << 52), at(parts[c].data, b.begin(i)),
        b.bytes(i) / elem, dtype, op, crossing_scratch + c * across_stride));
    progress();
  }
  for (size_t c = 0; c < chunks; ++c) {
    crossing[c]->finish();
    progress();
    inside_all_gather(ctx, lv, parts[c].data, parts[c].blocks, gather_tag,
                      std::move(gather_recvs[c]));
  }
}

}  // namespace dtrain::algorithms
