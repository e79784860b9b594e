#include "transport/shm/slots.h"

#include <algorithm>

#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "transport/shm/attach.h"

namespace dtrain::shm {
namespace {

constexpr uint64_t kMagic = 0x64747261696e7368ULL;  // "dtrainsh"
constexpr uint32_t kVersion = 2;
constexpr size_t kLine = Slots::kLine;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// Where each part of the segment starts, from the group size and the slot
// half size (the same computation on every rank).
struct Layout {
  size_t counters, stamps, tables, data, total;
  Layout(int n, size_t half_bytes) {
    counters = round_up(sizeof(SegmentHeader), kLine);
    stamps = counters + n * kLine;
    tables = stamps + 2 * n * Slots::kStampBytes;
    data = round_up(tables + 2 * 2 * size_t(n) * n * sizeof(int64_t), 4096);
    total = data + size_t(n) * 2 * half_bytes;
  }
};

}  // namespace

size_t Slots::chunk_bytes(int ranks) {
  const auto text = env::get(env::kShmChunkBytes);
  if (text && *text != "auto")
    return static_cast<size_t>(*env::get_int(env::kShmChunkBytes, 4096, 1LL << 30));
  // Few pieces (each costs a barrier: 128 KiB ones took 3.2 ms for a 16 MiB
  // all_reduce of 2 ranks, 1 MiB ones 1.6-1.8 ms), within 8 MiB a group.
  const size_t budget = size_t{8} << 20;
  return std::clamp<size_t>(budget / (2 * static_cast<size_t>(ranks)) / 4096 * 4096,
                            size_t{128} << 10, size_t{1} << 20);
}

Slots::Slots(Store& store, int rank, int size, const std::string& name)
    : rank_(rank), size_(size) {
  attach(store, name);
  barrier_ = std::make_unique<PhaseBarrier>(counters_, rank, size, segment_);
  DTRAIN_LOG_INFO("shm: group '", name, "' attached to /dev/shm", segment_.name(), " (",
                  segment_.size() >> 10, " KiB), rank ", rank, "/", size);
}

void Slots::attach(Store& store, const std::string& name) {
  const int n = size_;
  SegmentPlan plan;
  plan.what = detail::cat("shm: setting up group '", name, "' (rank ", rank_, "/", n, ")");
  plan.kind = "a dtrain segment";
  plan.parts = "slots";
  plan.magic = kMagic;
  plan.version = kVersion;
  plan.part_bytes = [&] {
    // At least a cache line per rank and element, so a piece always splits.
    return round_up(std::max<size_t>(chunk_bytes(n), size_t(n) * kLine), 4096);
  };
  plan.total_bytes = [&](size_t half) { return Layout(n, half).total; };
  plan.part_bytes_valid = [&](uint64_t half) {
    return half >= std::max<size_t>(4096, size_t(n) * kLine) && half <= (uint64_t{1} << 30) &&
           half % 4096 == 0;
  };
  segment_ = attach_segment(store, rank_, n, plan);
  half_bytes_ = static_cast<size_t>(header_of(segment_).part_bytes);

  const Layout layout(n, half_bytes_);
  auto* base = static_cast<uint8_t*>(segment_.data());
  counters_ = reinterpret_cast<PhaseCounter*>(base + layout.counters);
  stamps_ = base + layout.stamps;
  tables_ = reinterpret_cast<int64_t*>(base + layout.tables);
  data_ = base + layout.data;
}

void Slots::abort(const std::string& why) {
  barrier_->abort(why);
  segment_.unlock_slot(rank_);
}

}  // namespace dtrain::shm
