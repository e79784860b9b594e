// Splitting a sequence over a context-parallel group (context_parallel.h).

#include "context_parallel/sharding.h"

#include <ATen/ATen.h>

#include "common/enforce.h"
#include "tensor_parallel/group.h"

namespace dtrain::context_parallel {
namespace detail {

void check_attention_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* what) {
  DTRAIN_CHECK_ARG(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, what,
                   ": q, k and v must be [batch, heads, seq, head_dim], got ", q.sizes(), ", ", k.sizes(),
                   " and ", v.sizes());
  DTRAIN_CHECK_ARG(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                       k.size(3) == q.size(3),
                   what, ": k and v must be [", q.size(0), ", kv_heads, ", q.size(2), ", ", q.size(3),
                   "] beside q ", q.sizes(), ", got ", k.sizes(), " and ", v.sizes());
  DTRAIN_CHECK_ARG(k.size(1) > 0 && q.size(1) % k.size(1) == 0, what, ": q's ", q.size(1),
                   " heads are not a multiple of k and v's ", k.size(1));
}

const char* sharding_name(Sharding sharding) {
  return sharding == Sharding::kHeadTail ? "head-tail" : "contiguous";
}

int64_t chunk_length(int64_t length, int64_t ranks, Sharding sharding, const char* what) {
  const int64_t chunks = ranks * chunks_per_rank(sharding);
  DTRAIN_CHECK_ARG(length > 0 && length % chunks == 0, what, ": a sequence of ", length,
                   " does not split into the ", chunks, " equal chunks that ", sharding_name(sharding),
                   " sharding over ", ranks, " ranks needs");
  return length / chunks;
}

std::vector<int64_t> gathered_positions(int64_t length, int64_t ranks, Sharding sharding) {
  const int64_t chunk = chunk_length(length, ranks, sharding, "context parallelism");
  std::vector<int64_t> positions;
  positions.reserve(static_cast<size_t>(length));
  for (int64_t r = 0; r < ranks; ++r)
    for (int64_t c : chunks_of(r, ranks, sharding))
      for (int64_t i = 0; i < chunk; ++i) positions.push_back(c * chunk + i);
  return positions;
}

}  // namespace detail

namespace {

int64_t checked_dim(const at::Tensor& t, int64_t dim, const char* what) {
  DTRAIN_CHECK_ARG(dim >= -t.dim() && dim < t.dim(), what, ": no dimension ", dim, " in a tensor of shape ",
                   t.sizes());
  return dim < 0 ? dim + t.dim() : dim;
}

}  // namespace

at::Tensor shard_sequence(const at::Tensor& whole, int64_t dim, const std::shared_ptr<ProcessGroup>& group,
                          Sharding sharding) {
  const char* what = "shard_sequence";
  auto g = tensor_parallel::detail::group_or_default(group, what);
  dim = checked_dim(whole, dim, what);
  const int64_t chunk = detail::chunk_length(whole.size(dim), g->size(), sharding, what);
  std::vector<at::Tensor> parts;
  for (int64_t c : detail::chunks_of(g->rank(), g->size(), sharding))
    parts.push_back(whole.narrow(dim, c * chunk, chunk));
  return parts.size() == 1 ? parts[0] : at::cat(parts, dim);
}

at::Tensor sequence_positions(int64_t length, const std::shared_ptr<ProcessGroup>& group, Sharding sharding) {
  const char* what = "sequence_positions";
  auto g = tensor_parallel::detail::group_or_default(group, what);
  const int64_t chunk = detail::chunk_length(length, g->size(), sharding, what);
  std::vector<at::Tensor> parts;
  for (int64_t c : detail::chunks_of(g->rank(), g->size(), sharding))
    parts.push_back(at::arange(c * chunk, (c + 1) * chunk, at::kLong));
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

at::Tensor unshard_sequence(const at::Tensor& part, int64_t dim, const std::shared_ptr<ProcessGroup>& group,
                            Sharding sharding) {
  const char* what = "unshard_sequence";
  auto g = tensor_parallel::detail::group_or_default(group, what);
  dim = checked_dim(part, dim, what);
  const int64_t c = g->size(), length = part.size(dim) * c;
  at::NoGradGuard no_grad;
  // Gathered along a new leading dimension, then laid out rank after rank.
  auto moved = part.movedim(dim, 0).contiguous();
  std::vector<int64_t> stacked = moved.sizes().vec();
  stacked.insert(stacked.begin(), c);
  auto gathered = at::empty(stacked, moved.options());
  g->all_gather_into_tensor(gathered, moved)->wait();
  auto in_rank_order = gathered.flatten(0, 1);
  // in_rank_order[i] holds position gathered_positions[i]: put it there.
  const auto positions = detail::gathered_positions(length, c, sharding);
  auto where = at::tensor(positions, at::kLong);
  auto whole = at::empty_like(in_rank_order);
  whole.index_copy_(0, where, in_rank_order);
  return whole.movedim(0, dim).contiguous();
}

}  // namespace dtrain::context_parallel
