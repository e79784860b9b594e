#pragma once

// torch.utils.data.DistributedSampler for libtorch's data loaders.
//
//   auto sampler = dtrain::DistributedSampler(dataset.size().value());  // default group
//   auto loader = torch::data::make_data_loader(
//       dataset, sampler, torch::data::DataLoaderOptions().batch_size(64).workers(2));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);            // a new shuffle order every epoch
//     for (auto& batch : *loader) { ... }
//   }
//
// Semantics (PyTorch's, see docs/data.md): each epoch, the indices 0..N-1
// are shuffled with a generator seeded by seed + epoch, identically on every
// rank; without drop_last the list is padded by repeating its head until
// num_replicas divides it, with drop_last its tail is cut so that
// num_replicas divides it; rank r takes the entries r, r + num_replicas,
// r + 2 * num_replicas, ... Every rank gets num_samples() indices:
// ceil(N / num_replicas), or floor(N / num_replicas) with drop_last.
//
// A DistributedSampler is a handle: copies share one state. make_data_loader
// keeps its own copy, so set_epoch / set_position on yours reach the loader.
// Construct a second sampler for an independent iteration.
//
// Thread safety: every member may be called from any thread (one mutex per
// shared state). libtorch's loader asks the sampler for indices from the
// thread that iterates it, also with worker threads.

#include <torch/data/samplers/base.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

struct DistributedSamplerOptions {
  // Number of ranks sharing the dataset; unset: the group's size.
  DTRAIN_ARG(std::optional<int>, num_replicas) = std::nullopt;
  // This rank, in [0, num_replicas); unset: the group's rank.
  DTRAIN_ARG(std::optional<int>, rank) = std::nullopt;
  // Where unset rank / num_replicas come from; null: the default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  // Shuffle every epoch (seeded by seed + epoch); false: 0, 1, 2, ... order.
  DTRAIN_ARG(bool, shuffle) = true;
  // Must be the same on every rank, or ranks see overlapping samples.
  DTRAIN_ARG(int64_t, seed) = 0;
  // Cut the tail instead of padding: no sample is seen twice in an epoch,
  // but up to num_replicas - 1 samples are skipped (different ones each
  // epoch when shuffling).
  DTRAIN_ARG(bool, drop_last) = false;
};

class DistributedSampler : public torch::data::samplers::Sampler<> {
 public:
  // Throws InvalidArgument for dataset_size 0, num_replicas < 1, a rank
  // outside [0, num_replicas), or (with rank / num_replicas unset) no
  // default group or a group this process is not a member of. The order of
  // epoch 0 is ready at once: next() works without a reset().
  explicit DistributedSampler(
      size_t dataset_size, const DistributedSamplerOptions& options = DistributedSamplerOptions());

  // The epoch whose order the next reset() builds (PyTorch's set_epoch).
  // Call it before every epoch: with shuffle on, starting two epochs in a
  // row with the same epoch number logs a warning (once per sampler), since
  // every epoch would repeat the same order.
  void set_epoch(int64_t epoch);
  int64_t epoch() const;

  // Starts an epoch: builds this rank's order for epoch() (and an optional
  // new dataset size) and rewinds to its start, or to the position given by
  // set_position()/load() since the last reset. libtorch's data loader calls
  // it at the start of every iteration over the loader.
  void reset(torch::optional<size_t> new_size = torch::nullopt) override;

  // The next up to batch_size indices of this epoch; nullopt once the epoch
  // is exhausted. The last batch may be shorter.
  torch::optional<std::vector<size_t>> next(size_t batch_size) override;

  // How many of this epoch's num_samples() indices next() has handed out.
  // With workers(0) this is exactly what the training loop has consumed.
  // With workers > 0 the loader prefetches up to max_jobs batches
  // (2 * workers by default), so position() runs ahead of the loop: to
  // checkpoint, store the number of samples your loop has consumed instead.
  size_t position() const;

  // Resume mid-epoch: the current epoch continues at `position` (in
  // [0, num_samples()], InvalidArgument otherwise), and so does the epoch
  // started by the next reset() — the one a data loader does when iterated —
  // after which epochs start at 0 again. Typical resume:
  //   sampler.set_epoch(saved_epoch); sampler.set_position(saved_position);
  //   for (auto& batch : *loader) ...   // the remaining batches of that epoch
  void set_position(size_t position);

  // The epoch's progress over all ranks: how many entries of its global
  // order (the shuffled dataset that the ranks deal out among themselves)
  // have been handed out by every rank together, at most dataset_size().
  // Store this, not position(), to resume at another world size.
  size_t global_position() const;

  // Resume mid-epoch at any world size: the current epoch (and the one the
  // next reset() starts) skips the first `samples` entries of its global
  // order — those consumed, for example, by a job with a different number
  // of ranks — and deals out only the rest: num_samples() becomes
  // ceil((dataset_size - samples) / num_replicas) (floor with drop_last),
  // padding repeats the epoch's head. Every remaining sample is seen once;
  // with an unchanged world size this is exactly set_position(samples /
  // num_replicas). `samples` in [0, dataset_size()], InvalidArgument
  // otherwise. Later epochs start at 0 again. Typical resume:
  //   sampler.set_epoch(saved_epoch); sampler.set_global_position(saved_samples);
  void set_global_position(size_t samples);

  // Writes epoch, position, global position and the configuration that determines the order
  // (dataset size, num_replicas, seed, shuffle, drop_last).
  void save(torch::serialize::OutputArchive& archive) const override;
  // Restores epoch and position: the current order becomes the saved
  // epoch's, continuing at the saved position, and the next reset() resumes
  // there too (as set_epoch + set_position). Throws InvalidArgument when the
  // archive's configuration differs from this sampler's (the saved position
  // would then name other samples). The rank may differ: all ranks share
  // epoch and position, so one rank's archive serves every rank.
  void load(torch::serialize::InputArchive& archive) override;

  // Indices per rank per epoch (len() of PyTorch's sampler); fewer in an
  // epoch resumed with set_global_position.
  size_t num_samples() const;
  // num_samples() * num_replicas(): the padded or cut epoch length.
  size_t total_size() const;
  size_t dataset_size() const;
  int rank() const;
  int num_replicas() const;
  // This rank's whole order for the current epoch (as built by the last
  // reset, or by the constructor).
  std::vector<size_t> indices() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace dtrain
