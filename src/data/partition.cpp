#include "data/partition.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

namespace dtrain::data {

size_t samples_per_replica(size_t dataset_size, size_t num_replicas, bool drop_last) {
  // PyTorch writes the drop_last case as ceil((N - R) / R) when R does not
  // divide N; for N >= 0 that is floor(N / R), including N < R (0 samples).
  if (drop_last) return dataset_size / num_replicas;
  return (dataset_size + num_replicas - 1) / num_replicas;
}

// PyTorch builds the whole list and slices it:
//   indices = randperm(N, generator seeded seed + epoch)    (or range(N))
//   padding: indices += (indices * ceil(pad / N))[:pad]     (not drop_last)
//   cutting: indices = indices[:total_size]                 (drop_last)
//   return indices[rank:total_size:num_replicas]
// Entry j of the padded list is perm[j % N] (padding repeats the list from
// its head, as many times as needed when R > N), and a cut list is a prefix
// of perm, so rank r's i-th index is perm[(r + i * R) % N] in both cases;
// we compute just those instead of materializing the padded list.
//
// With `skip` entries of that list already consumed (by ranks of an earlier
// world size), the ranks deal out perm[skip], perm[skip + 1], ... the same
// way: rank r's i-th index is perm[(skip + r + i * R) % N], and there are
// samples_per_replica(N - skip, R) of them. For skip = p * R this is the
// tail of the full order from position p, so resuming through the global
// position at an unchanged world size repeats the uninterrupted run exactly.
//
// The permutation is ATen's randperm on a CPU generator (mt19937) seeded
// with seed + epoch — the generator and kernel torch.randperm(N,
// generator=g) runs in Python for g.manual_seed(seed + epoch) — so every
// rank computes the same permutation without communicating.
std::vector<size_t> partition_indices(const PartitionSpec& spec) {
  const size_t n = spec.dataset_size;
  const size_t count = samples_per_replica(n - std::min(n, spec.skip), spec.num_replicas, spec.drop_last);
  std::vector<size_t> out(count);
  if (count == 0) return out;

  auto at_index = [&](size_t i) { return (spec.skip + spec.rank + i * spec.num_replicas) % n; };
  if (!spec.shuffle) {
    for (size_t i = 0; i < count; ++i) out[i] = at_index(i);
    return out;
  }
  // Unsigned addition wraps like Python's manual_seed maps a negative seed.
  const uint64_t seed = static_cast<uint64_t>(spec.seed) + static_cast<uint64_t>(spec.epoch);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor perm =
      at::randperm(static_cast<int64_t>(n), generator, at::TensorOptions().dtype(at::kLong));
  const int64_t* p = perm.data_ptr<int64_t>();
  for (size_t i = 0; i < count; ++i) out[i] = static_cast<size_t>(p[at_index(i)]);
  return out;
}

}  // namespace dtrain::data
