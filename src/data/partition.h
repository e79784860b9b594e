#pragma once

// The order of one epoch for one rank: torch.utils.data.DistributedSampler's
// algorithm as a pure function, so the sampler's state machine and the
// arithmetic stay apart (and the arithmetic is testable on its own).

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dtrain::data {

struct PartitionSpec {
  size_t dataset_size = 0;  // > 0
  size_t num_replicas = 1;  // > 0
  size_t rank = 0;          // < num_replicas
  bool shuffle = true;
  int64_t seed = 0;
  int64_t epoch = 0;
  bool drop_last = false;
  // Entries of the epoch's global order (all ranks') already consumed, in
  // [0, dataset_size]: the ranks share out only the rest (resuming at
  // another world size).
  size_t skip = 0;
};

// ceil(N / R), or floor(N / R) with drop_last (PyTorch's num_samples).
size_t samples_per_replica(size_t dataset_size, size_t num_replicas, bool drop_last);

// This rank's indices for the epoch: samples_per_replica(dataset_size -
// skip, ...) of them.
std::vector<size_t> partition_indices(const PartitionSpec& spec);

}  // namespace dtrain::data
