#include "checkpoint/storage/peer/peer.h"

#include <ATen/ATen.h>

#include "checkpoint/storage/part.h"
#include "common/enforce.h"
#include "dtrain/process_group.h"

namespace dtrain::checkpoint::storage::peer {
namespace {

// What a part of `state` can take at most: its tensors' bytes, its
// metadata, and a header allowance per entry (names, geometry, checksums).
int64_t largest_part(const DistributedState& state) {
  int64_t bytes = 1 << 20;
  auto entry = [&](const std::string& name, const at::Tensor& t) {
    bytes += static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()) +
             2 * static_cast<int64_t>(name.size()) + 4096;
  };
  for (const auto& [name, t] : state.replicated) entry(name, t);
  for (const auto& [name, s] : state.sharded) entry(name, s.local);
  for (const auto& [key, value] : state.metadata) bytes += 2 * static_cast<int64_t>(key.size() + value.size()) + 64;
  return bytes;
}

}  // namespace

void send_state(const DistributedState& state, int64_t step, int rank, int world, ProcessGroup& group,
                int dst, int tag) {
  for (const auto& hook : state.before_save) hook();
  Part part{state.replicated, state.sharded, state.metadata};
  std::string bytes = snapshot_part::encode(part, step, rank, world);
  auto size = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
  group.send(size, dst, tag)->wait();
  auto payload = at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte);
  group.send(payload, dst, tag)->wait();
}

Reader::Reader(ProcessGroup& group, int src, int tag, int64_t step, int rank, int world, std::string what)
    : group_(group), src_(src), tag_(tag), step_(step), rank_(rank), world_(world), what_(std::move(what)) {}

std::optional<Loaded> Reader::read(const DistributedState& state) {
  auto size = at::zeros({1}, at::kLong);
  group_.recv(size, src_, tag_)->wait();
  const int64_t n = size.item<int64_t>();
  const int64_t most = largest_part(state);
  DTRAIN_CHECK_ARG(n > 0 && n <= most, what_, ": the peer announced a part of ", n,
                   " bytes; a state of this layout takes at most ", most);
  std::string bytes(static_cast<size_t>(n), '\0');
  group_.recv(at::from_blob(bytes.data(), {n}, at::kByte), src_, tag_)->wait();
  auto decoded = snapshot_part::check(bytes, state, step_, rank_, world_, what_);
  DTRAIN_CHECK_ARG(decoded.needs.empty(), what_, ": the peer's part lacks ", decoded.needs.front(),
                   ", which the state holds");
  Loaded loaded;
  loaded.fills = std::move(decoded.fills);
  loaded.metadata = std::move(decoded.metadata);
  return loaded;
}

}  // namespace dtrain::checkpoint::storage::peer
