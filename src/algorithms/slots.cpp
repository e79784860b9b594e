// Collectives over the shm transport's slots (see slots.h).

#include "algorithms/slots.h"

#include <algorithm>
#include <cstring>

#include "algorithms/reduce_kernels.h"
#include "common/enforce.h"

namespace dtrain::algorithms::slots {
namespace {

constexpr size_t kLine = shm::Slots::kLine;

// memcpy that accepts the null data pointer of an empty tensor (memcpy's
// arguments must be valid pointers even for 0 bytes; UBSan reports it).
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

uint8_t* bytes(void* p) { return static_cast<uint8_t*>(p); }
const uint8_t* bytes(const void* p) { return static_cast<const uint8_t*>(p); }

// A piece of `count` elements split into one region per rank, each a whole
// number of cache lines where the element size allows. In a slot, region j
// always starts at j * stride (the region length of a full piece), whatever
// this piece's length: successive pieces then never move a region over
// another rank's, which the pipelined all_reduce relies on.
struct Regions {
  size_t count, len, stride;
  Regions(size_t count_, int n, size_t elem, size_t stride_ = 0) : count(count_) {
    const size_t align = std::max<size_t>(1, kLine / elem);
    len = round_up((count + n - 1) / n, align);
    stride = stride_ ? stride_ : len;
  }
  size_t begin(int j) const { return std::min(count, j * len); }
  size_t size(int j) const { return std::min(count, (j + 1) * len) - begin(j); }
  size_t slot_begin(int j) const { return j * stride; }
};

// What a rank called, in its slot of the segment.
struct alignas(kLine) Stamp {
  uint64_t seq;
  char op[24];
  int32_t dtype;      // -1: none
  int32_t root;       // -1: none
  int32_t reduce_op;  // -1: none
  int64_t count;      // elements; -1: checked elsewhere

  bool same(const Stamp& o) const {
    return seq == o.seq && std::strncmp(op, o.op, sizeof(op)) == 0 && dtype == o.dtype &&
           root == o.root && reduce_op == o.reduce_op && count == o.count;
  }
  std::string describe() const {
    std::string s = detail::cat(std::string(op, strnlen(op, sizeof(op))), " #", seq, "(");
    if (dtype >= 0) s += detail::cat(c10::toString(static_cast<c10::ScalarType>(dtype)), ", ");
    if (count >= 0) s += detail::cat(count, " elements");
    if (root >= 0) s += detail::cat(", root ", root);
    if (reduce_op >= 0) s += detail::cat(", ", to_string(static_cast<ReduceOp>(reduce_op)));
    return s + ")";
  }
};
static_assert(sizeof(Stamp) <= shm::Slots::kStampBytes, "a stamp fits its place");

// One collective in progress: its barrier steps, the first of which also
// verifies that every rank called the same thing.
class Step {
 public:
  // Writes this rank's stamp for the collective before its first barrier.
  Step(const Call& c, int dtype, int64_t count, int root, int reduce_op)
      : c_(c), s_(c.slots), index_(s_.collectives_run++) {
    Stamp st{};
    st.seq = c.seq;
    // Not snprintf: this runs in every collective, and formatting cost more
    // than the rest of the stamp.
    std::strncpy(st.op, c.op, sizeof(st.op) - 1);
    st.dtype = dtype;
    st.count = count;
    st.root = root;
    st.reduce_op = reduce_op;
    stamp_ = st;
    *static_cast<Stamp*>(s_.stamp(s_.rank(), index_)) = st;
  }

  shm::Slots& slots() { return s_; }
  uint64_t index() const { return index_; }

  // Every collective takes exactly one half before its first barrier, so
  // that after a mismatch (raised at that barrier) all ranks still agree on
  // which half comes next.
  int next_half() { return static_cast<int>(s_.pieces++ & 1); }

  void sync() {
    s_.barrier().arrive_and_wait(c_.deadline, c_.what);
    if (!checked_) check();
  }

 private:
  void check() {
    checked_ = true;
    const int n = s_.size();
    auto of = [&](int r) -> const Stamp& { return *static_cast<const Stamp*>(s_.stamp(r, index_)); };
    bool same = true;
    for (int r = 0; r < n; ++r) same = same && of(r).same(stamp_);
    if (same) return;
    std::string ranks;
    for (int r = 0; r < n; ++r) ranks += detail::cat("\n  rank ", r, ": ", of(r).describe());
    throw Mismatch(detail::cat(
        "shm: ranks called different collectives at ", c_.what, ":", ranks,
        "\nEvery rank of a group must issue the same collectives, in the same order, on tensors "
        "of the same size and dtype."));
  }

  const Call& c_;
  shm::Slots& s_;
  // Counted here, not taken from the call's seq, because DTRAIN_DEBUG=DETAIL
  // runs a fingerprint all_gather under the same seq right before the call.
  const uint64_t index_;
  Stamp stamp_{};
  bool checked_ = false;
};

int dtype_of(c10::ScalarType t) { return static_cast<int>(t); }

// Below this many bytes read by each rank (its data times the ranks), an
// all_reduce takes one barrier instead of two (one_shot_all_reduce).
constexpr size_t kOneShotBytes = 64 * 1024;

// Each rank copies its whole data into its slot and, after the barrier,
// reduces every rank's copy itself, in rank order as the reduce-scatter
// does, so every rank gets the same bits it would have. The next
// collective takes the other half; the one after that waits at its first
// barrier until every rank is past this one, so no rank overwrites a slot
// half that a peer still reads.
void one_shot_all_reduce(Step& step, void* data, size_t count, c10::ScalarType dtype,
                         ReduceOp op) {
  auto& s = step.slots();
  const int n = s.size();
  const int h = step.next_half();
  copy_bytes(s.slot(s.rank(), h), data, count * c10::elementSize(dtype));
  step.sync();
  std::vector<const void*> srcs(n);
  for (int j = 0; j < n; ++j) srcs[j] = s.slot(j, h);
  kernels::reduce_into(dtype, op, data, nullptr, srcs.data(), n, count, n);
}

}  // namespace

void all_reduce(const Call& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  Step step(c, dtype_of(dtype), static_cast<int64_t>(count), -1, static_cast<int>(op));
  auto& s = step.slots();
  const int n = s.size(), me = s.rank();
  const size_t elem = c10::elementSize(dtype);
  if (count * elem <= s.half_bytes() && count * elem * n <= kOneShotBytes)
    return one_shot_all_reduce(step, data, count, dtype, op);
  const size_t align = std::max<size_t>(1, kLine / elem);
  const size_t stride = s.half_bytes() / elem / n / align * align;  // >= align (see Slots)
  const size_t piece = stride * n;
  const size_t pieces = std::max<size_t>(1, (count + piece - 1) / piece);
  std::vector<const void*> srcs(n);
  // Piece k lives in slot half (first + k) % 2, alternating as in every
  // collective. Pipelined: while piece k is reduced, piece k+1 is already
  // copied in, so each piece costs one barrier (plus one to start).
  // s.pieces moves past the later pieces only once the first barrier has
  // shown that every rank has the same count: after a mismatch all ranks
  // must agree on the next half.
  const uint64_t first = s.pieces;
  s.pieces = first + 1;
  auto half_of = [&](size_t k) { return static_cast<int>((first + k) & 1); };
  auto at = [&](size_t k) {
    const size_t off = k * piece;
    return std::make_pair(Regions(std::min(piece, count - std::min(off, count)), n, elem, stride),
                          bytes(data) + off * elem);
  };
  // Reduce-scatter: hand the others the parts of piece k they reduce.
  auto copy_in = [&](size_t k) {
    const auto [rg, src] = at(k);
    uint8_t* mine = s.slot(me, half_of(k));
    for (int j = 0; j < n; ++j)
      if (j != me)
        copy_bytes(mine + rg.slot_begin(j) * elem, src + rg.begin(j) * elem, rg.size(j) * elem);
  };
  copy_in(0);
  step.sync();
  s.pieces = first + pieces;
  for (size_t k = 0; k < pieces; ++k) {
    if (k + 1 < pieces) copy_in(k + 1);
    // Reduce my part of piece k from every slot and my own buffer, into my
    // buffer and my slot...
    const auto [rg, src] = at(k);
    const int h = half_of(k);
    const size_t b = rg.begin(me) * elem, sb = rg.slot_begin(me) * elem;
    for (int j = 0; j < n; ++j) srcs[j] = j == me ? src + b : s.slot(j, h) + sb;
    kernels::reduce_into(dtype, op, s.slot(me, h) + sb, src + b, srcs.data(), n, rg.size(me), n);
    step.sync();
    // ...then all-gather: take the others' results.
    for (int j = 0; j < n; ++j)
      if (j != me)
        copy_bytes(src + rg.begin(j) * elem, s.slot(j, h) + rg.slot_begin(j) * elem,
                   rg.size(j) * elem);
  }
}

void reduce(const Call& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op,
            int root) {
  Step step(c, dtype_of(dtype), static_cast<int64_t>(count), root, static_cast<int>(op));
  auto& s = step.slots();
  const int n = s.size(), me = s.rank();
  const size_t elem = c10::elementSize(dtype);
  const size_t piece = s.half_bytes() / elem;
  std::vector<const void*> srcs(n);
  for (size_t off = 0; off == 0 || off < count; off += piece) {
    const Regions rg(std::min(piece, count - std::min(off, count)), n, elem);
    const int h = step.next_half();
    uint8_t* mine = s.slot(me, h);
    uint8_t* src = bytes(data) + off * elem;
    for (int j = 0; j < n; ++j)
      if (j != me) copy_bytes(mine + rg.begin(j) * elem, src + rg.begin(j) * elem, rg.size(j) * elem);
    step.sync();
    const size_t b = rg.begin(me) * elem;
    for (int j = 0; j < n; ++j) srcs[j] = j == me ? src + b : s.slot(j, h) + b;
    kernels::reduce_into(dtype, op, mine + b, nullptr, srcs.data(), n, rg.size(me), n);
    step.sync();
    // Only the root's buffer changes.
    if (me == root)
      for (int j = 0; j < n; ++j)
        copy_bytes(src + rg.begin(j) * elem, s.slot(j, h) + rg.begin(j) * elem, rg.size(j) * elem);
    if (count == 0) break;
  }
}

void broadcast(const Call& c, void* data, size_t count, c10::ScalarType dtype, int root) {
  Step step(c, dtype_of(dtype), static_cast<int64_t>(count), root, -1);
  auto& s = step.slots();
  const size_t total = count * c10::elementSize(dtype), half = s.half_bytes();
  for (size_t off = 0; off == 0 || off < total; off += half) {
    const size_t len = std::min(half, total - std::min(off, total));
    const int h = step.next_half();
    if (s.rank() == root) copy_bytes(s.slot(root, h), bytes(data) + off, len);
    step.sync();
    if (s.rank() != root) copy_bytes(bytes(data) + off, s.slot(root, h), len);
    if (total == 0) break;
  }
}

void gather(const Call& c, const std::vector<void*>& outputs, const void* input, size_t count,
            c10::ScalarType dtype, int root) {
  Step step(c, dtype_of(dtype), static_cast<int64_t>(count), root, -1);
  auto& s = step.slots();
  const int n = s.size(), me = s.rank();
  const size_t total = count * c10::elementSize(dtype), half = s.half_bytes();
  for (size_t off = 0; off == 0 || off < total; off += half) {
    const size_t len = std::min(half, total - std::min(off, total));
    const int h = step.next_half();
    copy_bytes(s.slot(me, h), bytes(input) + off, len);
    step.sync();
    if (root < 0 || me == root)
      for (int j = 0; j < n; ++j)
        copy_bytes(bytes(outputs[j]) + off, j == me ? bytes(input) + off : s.slot(j, h), len);
    if (total == 0) break;
  }
}

void scatter(const Call& c, void* output, const std::vector<const void*>& inputs, size_t count,
             c10::ScalarType dtype, int root) {
  Step step(c, dtype_of(dtype), static_cast<int64_t>(count), root, -1);
  auto& s = step.slots();
  const int n = s.size(), me = s.rank();
  const size_t total = count * c10::elementSize(dtype);
  const size_t region = std::max<size_t>(kLine, s.half_bytes() / n / kLine * kLine);
  for (size_t off = 0; off == 0 || off < total; off += region) {
    const size_t len = std::min(region, total - std::min(off, total));
    const int h = step.next_half();
    if (me == root)
      for (int j = 0; j < n; ++j)
        if (j != root) copy_bytes(s.slot(root, h) + j * region, bytes(inputs[j]) + off, len);
    step.sync();
    const auto* src = me == root ? bytes(inputs[root]) + off : s.slot(root, h) + me * region;
    copy_bytes(bytes(output) + off, src, len);
    if (total == 0) break;
  }
}

void reduce_scatter(const Call& c, void* output, const std::vector<const void*>& inputs,
                    size_t count, c10::ScalarType dtype, ReduceOp op) {
  Step step(c, dtype_of(dtype), static_cast<int64_t>(count), -1, static_cast<int>(op));
  auto& s = step.slots();
  const int n = s.size(), me = s.rank();
  const size_t elem = c10::elementSize(dtype);
  const size_t region = std::max<size_t>(kLine, s.half_bytes() / n / kLine * kLine) / elem;
  // Same size and both contiguous: sharing a start means sharing every byte.
  const bool in_place = count > 0 && output == inputs[me];
  std::vector<const void*> srcs(n);
  for (size_t off = 0; off == 0 || off < count; off += region) {
    const size_t len = std::min(region, count - std::min(off, count));
    const int h = step.next_half();
    for (int j = 0; j < n; ++j)
      if (j != me)
        copy_bytes(s.slot(me, h) + j * region * elem, bytes(inputs[j]) + off * elem, len * elem);
    step.sync();
    for (int j = 0; j < n; ++j)
      srcs[j] = j == me ? bytes(inputs[me]) + off * elem : s.slot(j, h) + me * region * elem;
    // In place (PyTorch's reduce_scatter_tensor with the output a chunk of
    // the input, so output is inputs[me]), the output is also a source,
    // which reduce_into forbids for its destination: with three ranks or
    // more, my input would be overwritten by the partial sum before it is
    // added. Reduce instead into my own region of my slot, which no rank
    // reads, and let the kernel store the result a second time into the
    // output: the second destination may be exactly one of the sources.
    uint8_t* out = bytes(output) + off * elem;
    if (in_place)
      kernels::reduce_into(dtype, op, s.slot(me, h) + me * region * elem, out, srcs.data(), n,
                           len, n);
    else
      kernels::reduce_into(dtype, op, out, nullptr, srcs.data(), n, len, n);
    if (count == 0) break;
  }
}

void all_to_all(const Call& c, const std::vector<void*>& outputs,
                const std::vector<size_t>& out_bytes, const std::vector<const void*>& inputs,
                const std::vector<size_t>& in_bytes, c10::ScalarType dtype) {
  Step step(c, dtype_of(dtype), -1, -1, -1);
  auto& s = step.slots();
  const int n = s.size(), me = s.rank();
  step.next_half();  // every collective takes one half before its first barrier
  // Publish what I send to and expect from each peer, then check the whole
  // matrix, so that every rank reports the same mismatch.
  int64_t* sends = s.exchange_table(step.index());  // [from][to]
  int64_t* expects = sends + n * n;                  // [at][from]
  for (int j = 0; j < n; ++j) {
    sends[me * n + j] = static_cast<int64_t>(in_bytes[j]);
    expects[me * n + j] = static_cast<int64_t>(out_bytes[j]);
  }
  step.sync();
  int64_t longest = 0;
  for (int from = 0; from < n; ++from)
    for (int to = 0; to < n; ++to) {
      if (sends[from * n + to] != expects[to * n + from])
        throw SizeMismatch(detail::cat(
            c.what, ": rank ", from, " sends ", sends[from * n + to], " bytes to rank ", to,
            ", which expects ", expects[to * n + from], " bytes (outputs[", from, "] on rank ",
            to, " must match inputs[", to, "] on rank ", from, ")"));
      longest = std::max(longest, sends[from * n + to]);
    }
  const size_t region = std::max<size_t>(kLine, s.half_bytes() / n / kLine * kLine);
  for (size_t off = 0; off < static_cast<size_t>(longest); off += region) {
    auto part = [&](int64_t length) {
      return std::min<size_t>(region, static_cast<size_t>(length) - std::min<size_t>(off, length));
    };
    const int h = step.next_half();
    for (int to = 0; to < n; ++to)
      if (to != me)
        copy_bytes(s.slot(me, h) + to * region, bytes(inputs[to]) + off, part(sends[me * n + to]));
    step.sync();
    for (int from = 0; from < n; ++from) {
      const auto* src = from == me ? bytes(inputs[me]) + off : s.slot(from, h) + me * region;
      copy_bytes(bytes(outputs[from]) + off, src, part(sends[from * n + me]));
    }
  }
}

namespace {

// Block j of a buffer of blocks of `stride` elements, `count` in all, from
// element `off` of the block on, at most `len` elements: its first element
// and length.
std::pair<size_t, size_t> block_part(int j, size_t stride, size_t count, size_t off, size_t len) {
  const size_t begin = std::min(count, j * stride + off);
  const size_t end = std::min({count, (j + 1) * stride, j * stride + off + len});
  return {begin, std::max(begin, end) - begin};
}

}  // namespace

void reduce_scatter_blocks(const Call& c, void* data, size_t stride, size_t count,
                           c10::ScalarType dtype, ReduceOp op) {
  Step step(c, dtype_of(dtype), static_cast<int64_t>(count), -1, static_cast<int>(op));
  auto& s = step.slots();
  const int n = s.size(), me = s.rank();
  const size_t elem = c10::elementSize(dtype);
  const size_t region = std::max<size_t>(kLine, s.half_bytes() / n / kLine * kLine) / elem;
  std::vector<const void*> srcs(n);
  for (size_t off = 0; off == 0 || off < stride; off += region) {
    const int h = step.next_half();
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      const auto [b, len] = block_part(j, stride, count, off, region);
      copy_bytes(s.slot(me, h) + j * region * elem, bytes(data) + b * elem, len * elem);
    }
    step.sync();
    const auto [b, len] = block_part(me, stride, count, off, region);
    uint8_t* mine = bytes(data) + b * elem;
    for (int j = 0; j < n; ++j) srcs[j] = j == me ? mine : s.slot(j, h) + me * region * elem;
    // My buffer is a source and the destination: reduce into my own region
    // of my slot, which no rank reads, and store the result a second time
    // into my buffer (reduce_scatter's in-place case).
    kernels::reduce_into(dtype, op, s.slot(me, h) + me * region * elem, mine, srcs.data(), n,
                         len, 1);
    if (stride == 0) break;
  }
}

void all_gather_blocks(const Call& c, void* data, size_t stride, size_t count,
                       c10::ScalarType dtype) {
  Step step(c, dtype_of(dtype), static_cast<int64_t>(count), -1, -1);
  auto& s = step.slots();
  const int n = s.size(), me = s.rank();
  const size_t elem = c10::elementSize(dtype);
  const size_t region = std::max<size_t>(1, s.half_bytes() / elem);
  for (size_t off = 0; off == 0 || off < stride; off += region) {
    const int h = step.next_half();
    const auto [b, len] = block_part(me, stride, count, off, region);
    copy_bytes(s.slot(me, h), bytes(data) + b * elem, len * elem);
    step.sync();
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      const auto [jb, jlen] = block_part(j, stride, count, off, region);
      copy_bytes(bytes(data) + jb * elem, s.slot(j, h), jlen * elem);
    }
    if (stride == 0) break;
  }
}

void barrier(const Call& c) {
  Step step(c, -1, 0, -1, -1);
  step.next_half();  // every collective takes one half before its first barrier
  step.sync();
}

}  // namespace dtrain::algorithms::slots
