#include "transport/shm/attach.h"

#include <optional>
#include <vector>

#include "common/decimal.h"
#include "common/enforce.h"
#include "transport/shm/node.h"

namespace dtrain::shm {
namespace {

// Throws BackendUnavailable on every rank when the ranks are not on one node.
void check_one_node(Store& store, int rank, int n, const std::string& what) {
  store.set(detail::cat("shm/node/", rank), node_key());
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(store.get_string(detail::cat("shm/node/", r)));
  store.set(detail::cat("shm/node_read/", rank), "1");
  const auto nodes = group_by_node(keys);
  if (nodes.size() == 1) return;
  // Every rank fails the same way; rank 0, which often hosts the store,
  // leaves last so that nobody is cut off in the middle of reading.
  if (rank == 0) {
    std::vector<std::string> read;
    for (int r = 0; r < n; ++r) read.push_back(detail::cat("shm/node_read/", r));
    store.wait(read);
  }
  std::vector<std::string> parts;
  for (const auto& node : nodes) parts.push_back("ranks " + detail::join(node, ","));
  throw BackendUnavailable(detail::cat(
      what, ": the ranks are on ", nodes.size(), " different machines (",
      detail::join(parts, " | "),
      "); shm needs one machine. Use backend \"auto\" (shm within machines, tcp between "
      "them) or \"tcp\"."));
}

// Throws InternalError when the segment a rank mapped is not the one its
// group expects (a different build, a damaged or foreign segment).
void check_header(const Segment& segment, int n, const SegmentPlan& plan) {
  const auto& h = header_of(segment);
  if (h.magic != plan.magic || h.version != plan.version || h.size != static_cast<uint32_t>(n))
    throw InternalError(detail::cat(plan.what, ": /dev/shm", segment.name(), " is not ", plan.kind,
                                    " of this group (magic, version or size differ; a different "
                                    "dtrain build?)"));
  const uint64_t part = h.part_bytes;
  if (!plan.part_bytes_valid(part) || plan.total_bytes(static_cast<size_t>(part)) != segment.size())
    throw InternalError(detail::cat(plan.what, ": /dev/shm", segment.name(), " declares ", plan.parts,
                                    " of ", part, " bytes, which do not fit its ", segment.size(),
                                    " bytes for ", n, " ranks (a damaged or foreign segment)"));
}

}  // namespace

Segment attach_segment(Store& store, int rank, int n, const SegmentPlan& plan) {
  check_one_node(store, rank, n, plan.what);
  Segment segment;
  if (rank == 0) {
    remove_stale_segments();
    const size_t part = plan.part_bytes();
    segment = Segment::create(plan.total_bytes(part));
    *static_cast<SegmentHeader*>(segment.data()) =
        SegmentHeader{plan.magic, plan.version, static_cast<uint32_t>(n), part};
    segment.lock_slot(0);
    store.set("shm/segment", detail::cat(segment.name(), " ", segment.size()));
  } else {
    const auto published = store.get_string("shm/segment");
    const auto space = published.find(' ');
    const auto bytes = space == std::string::npos ? std::nullopt : detail::parse_decimal(published.substr(space + 1));
    DTRAIN_CHECK_ARG(bytes.has_value(), plan.what, ": the store's 'shm/segment' is '", published,
                     "', not a segment's name and size (a store other programs write to?)");
    segment = Segment::open(published.substr(0, space), static_cast<size_t>(*bytes));
    check_header(segment, n, plan);
    segment.lock_slot(rank);
  }
  // Once everyone holds the mapping, the name is no longer needed: rank 0
  // unlinks it (Segment's destructor does so on every failure path too).
  if (store.add("shm/attached", 1) == n) store.set("shm/ready", "1");
  store.wait({"shm/ready"});
  if (rank == 0) segment.unlink();
  return segment;
}

}  // namespace dtrain::shm
