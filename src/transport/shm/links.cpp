#include "transport/shm/links.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "common/enforce.h"
#include "transport/shm/attach.h"
#include "transport/shm/ring_link.h"

namespace dtrain::shm {
namespace {

constexpr uint64_t kRingMagic = 0x6474726e72696e67ULL;  // "dtrnring"
constexpr uint32_t kVersion = 1;

// Header, one doorbell per rank, then a ring per ordered pair of ranks.
struct Layout {
  size_t bells, rings, stride, total;
  int n;
  Layout(int n_, size_t ring_bytes) : n(n_) {
    bells = sizeof(shm::SegmentHeader);
    rings = (bells + size_t(n) * sizeof(shm::Doorbell) + 4095) / 4096 * 4096;
    stride = sizeof(shm::RingControl) + ring_bytes;
    total = rings + size_t(n) * (n - 1) * stride;
  }
  // The ring that carries `from`'s bytes to `to`.
  size_t ring(int from, int to) const {
    return rings + (size_t(from) * (n - 1) + (to < from ? to : to - 1)) * stride;
  }
};

}  // namespace

size_t ring_bytes(int ranks) {
  const size_t share = (size_t{32} << 20) / (size_t(ranks) * std::max(ranks - 1, 1));
  size_t bytes = size_t{16} << 10;
  while (bytes < (size_t{1} << 20) && bytes * 2 <= share) bytes *= 2;
  return bytes;
}

void add_ring_links(Store& store, int rank, const std::vector<int>& ranks, uint64_t granted,
                    const std::string& name, transport::engine::Links& links) {
  const int n = static_cast<int>(ranks.size());
  const int me = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  DTRAIN_ENFORCE(me < n);
  // Each rank's grant (its receive budget per peer) and pid, for the peers.
  store.set(detail::cat("shm/grant/", me), detail::cat(granted, " ", ::getpid()));

  const size_t ring_size = ring_bytes(n);
  shm::SegmentPlan plan;
  plan.what = detail::cat("shm: setting up the transport of group '", name, "' (rank ", rank,
                          ", ", me, "/", n, " on this machine)");
  plan.kind = "a ring segment";
  plan.parts = "rings";
  plan.magic = kRingMagic;
  plan.version = kVersion;
  plan.part_bytes = [&] { return ring_size; };
  plan.total_bytes = [&](size_t ring) { return Layout(n, ring).total; };
  plan.part_bytes_valid = [&](uint64_t ring) { return ring == ring_size; };
  auto segment = std::make_shared<shm::Segment>(shm::attach_segment(store, me, n, plan));

  const Layout layout(n, ring_size);
  auto* base = static_cast<uint8_t*>(segment->data());
  auto* bells = reinterpret_cast<shm::Doorbell*>(base + layout.bells);
  const int poller = static_cast<int>(links.pollers.size());
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    const int p = ranks[j];
    const auto grant = store.get_string(detail::cat("shm/grant/", j));
    char* end = nullptr;
    const uint64_t bytes = std::strtoull(grant.c_str(), &end, 10);
    if (end == grant.c_str() || *end != ' ' || bytes < transport::kMinEagerBytes)
      throw NetworkError(detail::cat(plan.what, ": rank ", p, " published a malformed grant '",
                                     grant.substr(0, 64), "' (a different dtrain build?)"));
    links.grants[p] = {bytes};
    links.peer_names[p] = detail::cat("rank ", p, " (pid ", std::string(end + 1).substr(0, 16), ", shm)");
    links.links[p].clear();
    links.links[p].push_back(std::make_unique<shm::RingLink>(
        reinterpret_cast<shm::RingControl*>(base + layout.ring(me, j)),
        reinterpret_cast<shm::RingControl*>(base + layout.ring(j, me)), ring_size, &bells[j], j));
    links.poller_of[p] = {poller};
  }
  links.pollers.push_back(std::make_unique<shm::RingPoller>(&bells[me], segment));
}

}  // namespace dtrain::shm
