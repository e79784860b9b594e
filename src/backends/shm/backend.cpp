#include "backends/shm/backend.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "backends/engine/group.h"
#include "transport/shm/attach.h"
#include "transport/shm/shm_transport.h"
#include "algorithms/reduce_kernels.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"
#include "dtrain/store/prefix_store.h"

namespace dtrain::shm {
namespace {

// memcpy that accepts the null data pointer of an empty tensor (memcpy's
// arguments must be valid pointers even for 0 bytes; UBSan reports it).
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}


constexpr uint64_t kMagic = 0x64747261696e7368ULL;  // "dtrainsh"
constexpr uint32_t kVersion = 1;
constexpr size_t kLine = 64;

struct alignas(kLine) Header {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t half_bytes;
};

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// Where each part of the segment starts, from the group size and the slot
// half size (the same computation on every rank).
struct Layout {
  size_t counters, stamps, tables, data, total;
  Layout(int n, size_t half_bytes) {
    counters = round_up(sizeof(Header), kLine);
    stamps = counters + n * kLine;
    tables = stamps + 2 * n * kLine;
    data = round_up(tables + 2 * 2 * size_t(n) * n * sizeof(int64_t), 4096);
    total = data + size_t(n) * 2 * half_bytes;
  }
};

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

uint8_t* bytes(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

}  // namespace

struct alignas(kLine) ShmProcessGroup::Stamp {
  uint64_t seq;
  char op[16];
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

// One collective in progress: its deadline and the barrier steps, the
// first of which also verifies that every rank called the same thing.
struct ShmProcessGroup::Step {
  ShmProcessGroup& group;
  const Call& call;
  Stamp stamp;
  PhaseBarrier::Clock::time_point deadline;
  // Which of the two stamp and exchange-table slots this collective uses:
  // counted here, not taken from call.seq, because DTRAIN_DEBUG=DETAIL runs
  // a fingerprint all_gather under the same seq right before the call.
  uint64_t index = group.collectives_run_++;
  bool checked = false;

  // Every collective takes exactly one half before its first barrier, so
  // that after a mismatch (raised at that barrier) all ranks still agree on
  // which half comes next.
  int next_half() { return static_cast<int>(group.pieces_++ & 1); }

  void sync() {
    group.barrier_->arrive_and_wait(deadline, call.description);
    if (!checked) check();
  }

  void check() {
    checked = true;
    const int n = group.size();
    auto of = [&](int r) -> const Stamp& { return group.stamps_[2 * r + index % 2]; };
    bool same = true;
    for (int r = 0; r < n; ++r) same = same && of(r).same(stamp);
    if (same) return;
    std::string ranks;
    for (int r = 0; r < n; ++r) ranks += detail::cat("\n  rank ", r, ": ", of(r).describe());
    throw CollectiveMismatch(detail::cat(
        "shm: ranks called different collectives at ", call.description, ":", ranks,
        "\nEvery rank of a group must issue the same collectives, in the same order, on tensors "
        "of the same size and dtype."));
  }
};

ShmProcessGroup::ShmProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                                 GroupOptions options)
    : ProcessGroup(rank, size, std::move(options)) {
  attach(*store);
  barrier_ = std::make_unique<PhaseBarrier>(counters_, rank, size, segment_);
  // Point to point: the tcp backend's engine over this machine's shared
  // memory (transport/shm/), in a segment of its own.
  p2p_ = std::make_shared<engine_backend::EngineProcessGroup>(
      std::make_shared<PrefixStore>("shm/p2p", std::move(store)), rank, size,
      GroupOptions(this->options()).name(name() + "/p2p").check_collectives(false),
      engine_backend::EngineProcessGroup::Carrier{
          [](Store& s, int r, int n, const GroupOptions& o) {
            transport::ShmOptions t;
            t.timeout = o.timeout();
            t.name = o.name();
            t.unexpected_bytes = static_cast<size_t>(
                *env::get_int(env::kTcpUnexpectedBytes, 65536, int64_t{1} << 50));
            return transport::connect_shm(s, r, n, t);
          },
          "shm", nullptr});
  DTRAIN_LOG_INFO("shm: group '", name(), "' attached to /dev/shm", segment_.name(), " (",
                  segment_.size() >> 10, " KiB), rank ", rank, "/", size);
}

ShmProcessGroup::~ShmProcessGroup() = default;

void ShmProcessGroup::attach(Store& store) {
  const int n = size();
  SegmentPlan plan;
  plan.what = detail::cat("shm: setting up group '", name(), "' (rank ", rank(), "/", n, ")");
  plan.bytes = [&] {
    half_bytes_ = static_cast<size_t>(*env::get_int(env::kShmChunkBytes, 4096, 1LL << 30));
    // At least a cache line per rank and element, so a piece always splits.
    half_bytes_ = round_up(std::max<size_t>(half_bytes_, size_t(n) * kLine), 4096);
    return Layout(n, half_bytes_).total;
  };
  plan.init = [&](void* base) {
    auto* header = static_cast<Header*>(base);
    header->size = static_cast<uint32_t>(n);
    header->half_bytes = half_bytes_;
    header->version = kVersion;
    header->magic = kMagic;
  };
  plan.check = [&](const Segment& segment) {
    const auto* header = static_cast<const Header*>(segment.data());
    if (header->magic != kMagic || header->version != kVersion ||
        header->size != static_cast<uint32_t>(n))
      throw InternalError(detail::cat(plan.what, ": /dev/shm", segment.name(),
                                      " is not a dtrain segment of this group (magic, version "
                                      "or size differ; a different dtrain build?)"));
    // Checked against the mapping before anything is placed by it.
    const uint64_t half = header->half_bytes;
    if (half < std::max<size_t>(4096, size_t(n) * kLine) || half > (uint64_t{1} << 30) ||
        half % 4096 != 0 || Layout(n, static_cast<size_t>(half)).total != segment.size())
      throw InternalError(detail::cat(plan.what, ": /dev/shm", segment.name(), " declares slots of ",
                                      half, " bytes, which do not fit its ", segment.size(),
                                      " bytes for ", n, " ranks (a damaged or foreign segment)"));
    half_bytes_ = static_cast<size_t>(half);
  };
  segment_ = attach_segment(store, rank(), n, plan);

  const Layout layout(n, half_bytes_);
  auto* base = static_cast<uint8_t*>(segment_.data());
  counters_ = reinterpret_cast<PhaseCounter*>(base + layout.counters);
  stamps_ = reinterpret_cast<Stamp*>(base + layout.stamps);
  tables_ = reinterpret_cast<int64_t*>(base + layout.tables);
  data_ = base + layout.data;
}

uint8_t* ShmProcessGroup::slot(int r, int half) const {
  return data_ + (static_cast<size_t>(r) * 2 + half) * half_bytes_;
}

int64_t* ShmProcessGroup::exchange_table(uint64_t index) const {
  const size_t n = size();
  return tables_ + (index % 2) * 2 * n * n;
}

// The executor's shared fate (core/serial_executor.h): a timeout or a dead
// peer breaks the group; a mismatch every rank saw at the same step does not.
WorkPtr ShmProcessGroup::enqueue(const Call& call, std::function<void(Step&)> body) {
  auto work = std::make_shared<Work>(call.description);
  collectives_.submit(work, [this, call, body = std::move(body)] {
    Step step{*this, call, {}, PhaseBarrier::Clock::now() + call.timeout};
    body(step);
  });
  return work;
}

namespace {

// Fills this rank's stamp for the collective before its first barrier.
template <typename Stamp>
void write_stamp(Stamp& dst, Stamp& kept, uint64_t seq, const char* op, const at::Tensor* t,
                 int64_t count, int root, int reduce_op) {
  Stamp s{};
  s.seq = seq;
  std::snprintf(s.op, sizeof(s.op), "%s", op);
  s.dtype = t ? static_cast<int32_t>(t->scalar_type()) : -1;
  s.count = count;
  s.root = root;
  s.reduce_op = reduce_op;
  dst = s;
  kept = s;
}

}  // namespace

#define DTRAIN_SHM_STAMP(step, tensor, count, root, reduce_op)                                 \
  write_stamp(stamps_[2 * rank() + (step).index % 2], (step).stamp, (step).call.seq,           \
              (step).call.op, tensor, count, root, reduce_op)

void ShmProcessGroup::all_reduce_now(Step& step, const at::Tensor& tensor, ReduceOp op) {
  const int n = size(), me = rank();
  const size_t elem = tensor.element_size();
  const size_t count = tensor.numel();
  const size_t align = std::max<size_t>(1, kLine / elem);
  const size_t stride = half_bytes_ / elem / n / align * align;  // >= align (see attach)
  const size_t piece = stride * n;
  const size_t pieces = std::max<size_t>(1, (count + piece - 1) / piece);
  DTRAIN_SHM_STAMP(step, &tensor, tensor.numel(), -1, static_cast<int>(op));
  std::vector<const void*> srcs(n);
  // Piece k lives in slot half (first + k) % 2, alternating as in every
  // collective. Pipelined: while piece k is reduced, piece k+1 is already
  // copied in, so each piece costs one barrier (plus one to start).
  // pieces_ moves past the later pieces only once the first barrier has
  // shown that every rank has the same count: after a mismatch all ranks
  // must agree on the next half.
  const uint64_t first = pieces_;
  pieces_ = first + 1;
  auto half_of = [&](size_t k) { return static_cast<int>((first + k) & 1); };
  auto at = [&](size_t k) {
    const size_t off = k * piece;
    return std::make_pair(Regions(std::min(piece, count - std::min(off, count)), n, elem, stride),
                          bytes(tensor) + off * elem);
  };
  // Reduce-scatter: hand the others the parts of piece k they reduce.
  auto copy_in = [&](size_t k) {
    const auto [rg, src] = at(k);
    uint8_t* mine = slot(me, half_of(k));
    for (int j = 0; j < n; ++j)
      if (j != me)
        copy_bytes(mine + rg.slot_begin(j) * elem, src + rg.begin(j) * elem, rg.size(j) * elem);
  };
  copy_in(0);
  step.sync();
  pieces_ = first + pieces;
  for (size_t k = 0; k < pieces; ++k) {
    if (k + 1 < pieces) copy_in(k + 1);
    // Reduce my part of piece k from every slot and my own tensor, into my
    // tensor and my slot...
    const auto [rg, src] = at(k);
    const int h = half_of(k);
    const size_t b = rg.begin(me) * elem, sb = rg.slot_begin(me) * elem;
    for (int j = 0; j < n; ++j) srcs[j] = j == me ? src + b : slot(j, h) + sb;
    kernels::reduce_into(tensor.scalar_type(), op, slot(me, h) + sb, src + b, srcs.data(), n, rg.size(me),
                n);
    step.sync();
    // ...then all-gather: take the others' results.
    for (int j = 0; j < n; ++j)
      if (j != me)
        copy_bytes(src + rg.begin(j) * elem, slot(j, h) + rg.slot_begin(j) * elem,
                    rg.size(j) * elem);
  }
}

void ShmProcessGroup::reduce_now(Step& step, const at::Tensor& tensor, int root, ReduceOp op) {
  const int n = size(), me = rank();
  const size_t elem = tensor.element_size();
  const size_t count = tensor.numel();
  const size_t piece = half_bytes_ / elem;
  DTRAIN_SHM_STAMP(step, &tensor, tensor.numel(), root, static_cast<int>(op));
  std::vector<const void*> srcs(n);
  for (size_t off = 0; off == 0 || off < count; off += piece) {
    const Regions rg(std::min(piece, count - std::min(off, count)), n, elem);
    const int h = step.next_half();
    uint8_t* mine = slot(me, h);
    uint8_t* src = bytes(tensor) + off * elem;
    for (int j = 0; j < n; ++j)
      if (j != me) copy_bytes(mine + rg.begin(j) * elem, src + rg.begin(j) * elem, rg.size(j) * elem);
    step.sync();
    const size_t b = rg.begin(me) * elem;
    for (int j = 0; j < n; ++j) srcs[j] = j == me ? src + b : slot(j, h) + b;
    kernels::reduce_into(tensor.scalar_type(), op, mine + b, nullptr, srcs.data(), n, rg.size(me), n);
    step.sync();
    // Only the root's tensor changes.
    if (me == root)
      for (int j = 0; j < n; ++j)
        copy_bytes(src + rg.begin(j) * elem, slot(j, h) + rg.begin(j) * elem, rg.size(j) * elem);
    if (count == 0) break;
  }
}

void ShmProcessGroup::gather_now(Step& step, const std::vector<at::Tensor>& outputs,
                                 const at::Tensor& input, int root) {
  const int n = size(), me = rank();
  const size_t total = input.nbytes();
  DTRAIN_SHM_STAMP(step, &input, input.numel(), root, -1);
  for (size_t off = 0; off == 0 || off < total; off += half_bytes_) {
    const size_t len = std::min(half_bytes_, total - std::min(off, total));
    const int h = step.next_half();
    copy_bytes(slot(me, h), bytes(input) + off, len);
    step.sync();
    if (root < 0 || me == root)
      for (int j = 0; j < n; ++j)
        copy_bytes(bytes(outputs[j]) + off, j == me ? bytes(input) + off : slot(j, h), len);
    if (total == 0) break;
  }
}

void ShmProcessGroup::all_to_all_now(Step& step, const std::vector<at::Tensor>& outputs,
                                     const std::vector<at::Tensor>& inputs) {
  const int n = size(), me = rank();
  DTRAIN_SHM_STAMP(step, &inputs[0], -1, -1, -1);
  step.next_half();  // every collective takes one half before its first barrier
  // Publish what I send to and expect from each peer, then check the whole
  // matrix, so that every rank reports the same mismatch.
  int64_t* sends = exchange_table(step.index);  // [from][to]
  int64_t* expects = sends + n * n;                // [at][from]
  for (int j = 0; j < n; ++j) {
    sends[me * n + j] = static_cast<int64_t>(inputs[j].nbytes());
    expects[me * n + j] = static_cast<int64_t>(outputs[j].nbytes());
  }
  step.sync();
  int64_t longest = 0;
  for (int from = 0; from < n; ++from)
    for (int to = 0; to < n; ++to) {
      if (sends[from * n + to] != expects[to * n + from])
        throw InvalidArgument(detail::cat(
            step.call.description, ": rank ", from, " sends ", sends[from * n + to],
            " bytes to rank ", to, ", which expects ", expects[to * n + from],
            " bytes (outputs[", from, "] on rank ", to, " must match inputs[", to, "] on rank ",
            from, ")"));
      longest = std::max(longest, sends[from * n + to]);
    }
  const size_t region = std::max<size_t>(kLine, half_bytes_ / n / kLine * kLine);
  for (size_t off = 0; off < static_cast<size_t>(longest); off += region) {
    auto part = [&](int64_t length) {
      return std::min<size_t>(region, static_cast<size_t>(length) - std::min<size_t>(off, length));
    };
    const int h = step.next_half();
    for (int to = 0; to < n; ++to)
      if (to != me)
        copy_bytes(slot(me, h) + to * region, bytes(inputs[to]) + off, part(sends[me * n + to]));
    step.sync();
    for (int from = 0; from < n; ++from) {
      const auto* src = from == me ? bytes(inputs[me]) + off : slot(from, h) + me * region;
      copy_bytes(bytes(outputs[from]) + off, src, part(sends[from * n + me]));
    }
  }
}

WorkPtr ShmProcessGroup::do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) {
  return enqueue(call, [this, tensor, op](Step& s) { all_reduce_now(s, tensor, op); });
}

WorkPtr ShmProcessGroup::do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) {
  return enqueue(call, [this, tensor, root, op](Step& s) { reduce_now(s, tensor, root, op); });
}

WorkPtr ShmProcessGroup::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  return enqueue(call, [this, tensor, root](Step& s) {
    const size_t total = tensor.nbytes();
    DTRAIN_SHM_STAMP(s, &tensor, tensor.numel(), root, -1);
    for (size_t off = 0; off == 0 || off < total; off += half_bytes_) {
      const size_t len = std::min(half_bytes_, total - std::min(off, total));
      const int h = s.next_half();
      if (rank() == root) copy_bytes(slot(root, h), bytes(tensor) + off, len);
      s.sync();
      if (rank() != root) copy_bytes(bytes(tensor) + off, slot(root, h), len);
      if (total == 0) break;
    }
  });
}

WorkPtr ShmProcessGroup::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                       at::Tensor input) {
  return enqueue(call, [this, outputs, input](Step& s) { gather_now(s, outputs, input, -1); });
}

WorkPtr ShmProcessGroup::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                                   at::Tensor input, int root) {
  return enqueue(call,
                 [this, outputs, input, root](Step& s) { gather_now(s, outputs, input, root); });
}

WorkPtr ShmProcessGroup::do_scatter(const Call& call, at::Tensor output,
                                    std::vector<at::Tensor> inputs, int root) {
  return enqueue(call, [this, output, inputs, root](Step& s) {
    const int n = size(), me = rank();
    const size_t total = output.nbytes();
    const size_t region = std::max<size_t>(kLine, half_bytes_ / n / kLine * kLine);
    DTRAIN_SHM_STAMP(s, &output, output.numel(), root, -1);
    for (size_t off = 0; off == 0 || off < total; off += region) {
      const size_t len = std::min(region, total - std::min(off, total));
      const int h = s.next_half();
      if (me == root)
        for (int j = 0; j < n; ++j)
          if (j != root) copy_bytes(slot(root, h) + j * region, bytes(inputs[j]) + off, len);
      s.sync();
      const auto* src = me == root ? bytes(inputs[root]) + off : slot(root, h) + me * region;
      copy_bytes(bytes(output) + off, src, len);
      if (total == 0) break;
    }
  });
}

WorkPtr ShmProcessGroup::do_reduce_scatter(const Call& call, at::Tensor output,
                                           std::vector<at::Tensor> inputs, ReduceOp op) {
  return enqueue(call, [this, output, inputs, op](Step& s) {
    const int n = size(), me = rank();
    const size_t elem = output.element_size();
    const size_t count = output.numel();
    const size_t region = std::max<size_t>(kLine, half_bytes_ / n / kLine * kLine) / elem;
    DTRAIN_SHM_STAMP(s, &output, output.numel(), -1, static_cast<int>(op));
    // Same size and both contiguous: sharing a start means sharing every byte.
    const bool in_place = count > 0 && output.data_ptr() == inputs[me].data_ptr();
    std::vector<const void*> srcs(n);
    for (size_t off = 0; off == 0 || off < count; off += region) {
      const size_t len = std::min(region, count - std::min(off, count));
      const int h = s.next_half();
      for (int j = 0; j < n; ++j)
        if (j != me)
          copy_bytes(slot(me, h) + j * region * elem, bytes(inputs[j]) + off * elem, len * elem);
      s.sync();
      for (int j = 0; j < n; ++j)
        srcs[j] = j == me ? bytes(inputs[me]) + off * elem : slot(j, h) + me * region * elem;
      // In place (PyTorch's reduce_scatter_tensor with the output a chunk of
      // the input, so output is inputs[me]), the output is also a source,
      // which reduce_into forbids for its destination: with three ranks or
      // more, my input would be overwritten by the partial sum before it is
      // added. Reduce instead into my own region of my slot, which no rank
      // reads, and let the kernel store the result a second time into the
      // output: the second destination may be exactly one of the sources.
      uint8_t* out = bytes(output) + off * elem;
      if (in_place)
        kernels::reduce_into(output.scalar_type(), op, slot(me, h) + me * region * elem, out,
                             srcs.data(), n, len, n);
      else
        kernels::reduce_into(output.scalar_type(), op, out, nullptr, srcs.data(), n, len, n);
      if (count == 0) break;
    }
  });
}

WorkPtr ShmProcessGroup::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                       std::vector<at::Tensor> inputs) {
  return enqueue(call,
                 [this, outputs, inputs](Step& s) { all_to_all_now(s, outputs, inputs); });
}

WorkPtr ShmProcessGroup::do_barrier(const Call& call) {
  return enqueue(call, [this](Step& s) {
    DTRAIN_SHM_STAMP(s, nullptr, 0, -1, -1);
    s.next_half();  // every collective takes one half before its first barrier
    s.sync();
  });
}

// On the tcp group of send/recv (shm's own barrier cannot tell who is
// missing), like send and recv outside the order of shm's collectives.
WorkPtr ShmProcessGroup::do_monitored_barrier(const Call& call, bool wait_all_ranks) {
  return p2p_->monitored_barrier(call.timeout, wait_all_ranks);
}

WorkPtr ShmProcessGroup::do_send(const Call& call, at::Tensor tensor, int dst, int tag) {
  return p2p_->send(std::move(tensor), dst, tag, call.timeout);
}

WorkPtr ShmProcessGroup::do_recv(const Call& call, at::Tensor tensor, int src, int tag) {
  return p2p_->recv(std::move(tensor), src, tag, call.timeout);
}

DTRAIN_REGISTER_BACKEND(shm, register_backend("shm", [](std::shared_ptr<Store> store, int rank,
                                                        int size, const GroupOptions& options) {
  if (*env::get_int(env::kShmDisable, 0, 1) == 1)
    throw BackendUnavailable(detail::cat(
        "shm: group '", options.name(), "' asks for shared memory, which DTRAIN_SHM_DISABLE=1 "
        "forbids; unset it, or use backend \"tcp\" (or \"auto\", which then uses tcp)"));
  return std::make_shared<ShmProcessGroup>(std::move(store), rank, size, options);
}))

}  // namespace dtrain::shm
