#include "dtrain/data/distributed_sampler.h"

#include <torch/serialize/archive.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "common/enforce.h"
#include "common/logging.h"
#include "data/partition.h"
#include "dtrain/distributed.h"

// Why not libtorch's torch::data::samplers::DistributedRandomSampler /
// DistributedSequentialSampler (torch/data/samplers/distributed.h)? They
// implement a different algorithm than torch.utils.data.DistributedSampler,
// so a C++ program would not see the samples a PyTorch program sees:
//   - rank r takes a contiguous block [r * n, (r + 1) * n) of the list, not
//     every num_replicas-th entry starting at r;
//   - padding is appended *before* shuffling (indices 0, 1, ... repeated and
//     then shuffled with the rest), and with allow_duplicates=false the list
//     is cut before shuffling too, so the same last samples of the dataset
//     are never seen in any epoch; PyTorch pads/cuts the shuffled list;
//   - padding writes i - N for i >= N, which is out of range once the
//     padding exceeds N (num_replicas > N, e.g. N = 1 and 4 ranks);
//   - the shuffle is std::shuffle over std::mt19937(epoch): no seed, and
//     std::shuffle's algorithm is left to the standard library, so libstdc++
//     and libc++ builds order samples differently;
//   - nothing warns when set_epoch is forgotten, and position/resume is not
//     exposed in a form that survives the loader's reset() at epoch start.
// The arithmetic lives in data/partition.cpp; this file is the state
// machine libtorch's Sampler interface needs.

namespace dtrain {

struct DistributedSampler::State {
  mutable std::mutex mutex;
  data::PartitionSpec spec;
  std::vector<size_t> indices;  // this rank's order for the current epoch
  size_t position = 0;          // next entry of `indices` to hand out
  // A position to start the next reset() at (set_position / load), once.
  std::optional<size_t> resume_at;
  // The global entries the next reset() skips (set_global_position / load), once.
  std::optional<size_t> resume_skip;
  // Epoch of the last reset(); the constructor's order is not an epoch
  // start, so a data loader's first reset does not look like a repeat.
  std::optional<int64_t> last_started_epoch;
  bool warned_same_epoch = false;

  void rebuild() { indices = data::partition_indices(spec); }
};

namespace {

std::pair<int, int> rank_and_replicas(const DistributedSamplerOptions& options) {
  if (options.num_replicas() && options.rank()) return {*options.rank(), *options.num_replicas()};
  auto group = options.process_group();
  if (!group) {
    DTRAIN_CHECK_ARG(is_initialized(),
                     "DistributedSampler: the default process group is not initialized; call "
                     "dtrain::init_process_group() first, or give both num_replicas and rank "
                     "in DistributedSamplerOptions");
    group = default_group();
  }
  DTRAIN_CHECK_ARG(group->rank() >= 0,
                   "DistributedSampler: this process is not a member of the given process group");
  return {options.rank().value_or(group->rank()), options.num_replicas().value_or(group->size())};
}

void check_position(size_t position, size_t num_samples, const char* where) {
  DTRAIN_CHECK_ARG(position <= num_samples, "DistributedSampler::", where, ": position ", position,
                   " is past the end of the epoch (num_samples ", num_samples, ")");
}

}  // namespace

DistributedSampler::DistributedSampler(size_t dataset_size,
                                       const DistributedSamplerOptions& options)
    : state_(std::make_shared<State>()) {
  DTRAIN_CHECK_ARG(dataset_size > 0, "DistributedSampler: dataset_size must be positive, got 0");
  if (options.num_replicas())
    DTRAIN_CHECK_ARG(*options.num_replicas() >= 1,
                     "DistributedSampler: num_replicas must be at least 1, got ",
                     *options.num_replicas());
  const auto [rank, replicas] = rank_and_replicas(options);
  DTRAIN_CHECK_ARG(replicas >= 1, "DistributedSampler: num_replicas must be at least 1, got ",
                   replicas);
  DTRAIN_CHECK_ARG(rank >= 0 && rank < replicas, "DistributedSampler: rank ", rank,
                   " is outside [0, ", replicas, ") (num_replicas ", replicas, ")");
  auto& spec = state_->spec;
  spec.dataset_size = dataset_size;
  spec.num_replicas = static_cast<size_t>(replicas);
  spec.rank = static_cast<size_t>(rank);
  spec.shuffle = options.shuffle();
  spec.seed = options.seed();
  spec.drop_last = options.drop_last();
  state_->rebuild();
}

void DistributedSampler::set_epoch(int64_t epoch) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->spec.epoch = epoch;
}

int64_t DistributedSampler::epoch() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->spec.epoch;
}

void DistributedSampler::reset(torch::optional<size_t> new_size) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto& s = *state_;
  if (new_size) {
    DTRAIN_CHECK_ARG(*new_size > 0, "DistributedSampler::reset: the new dataset size must be "
                                    "positive, got 0");
    s.spec.dataset_size = *new_size;
  }
  if (s.spec.shuffle && s.last_started_epoch == s.spec.epoch && !s.warned_same_epoch) {
    s.warned_same_epoch = true;
    log_warning(detail::cat(
        "DistributedSampler: epoch ", s.spec.epoch,
        " started again with the same shuffle order as the previous epoch; call "
        "sampler.set_epoch(epoch) before each epoch, or every epoch repeats this order "
        "(warned once)"));
  }
  s.last_started_epoch = s.spec.epoch;
  s.spec.skip = std::min(s.resume_skip.value_or(0), s.spec.dataset_size);
  s.resume_skip.reset();
  s.rebuild();
  const size_t start = s.resume_at.value_or(0);
  s.resume_at.reset();
  check_position(start, s.indices.size(), "reset");
  s.position = start;
}

torch::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto& s = *state_;
  if (s.position >= s.indices.size()) return torch::nullopt;
  const size_t end = std::min(s.indices.size(), s.position + batch_size);
  std::vector<size_t> batch(s.indices.begin() + static_cast<std::ptrdiff_t>(s.position),
                            s.indices.begin() + static_cast<std::ptrdiff_t>(end));
  s.position = end;
  return batch;
}

size_t DistributedSampler::position() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->position;
}

void DistributedSampler::set_position(size_t position) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  check_position(position, state_->indices.size(), "set_position");
  state_->position = position;
  state_->resume_at = position;
  state_->resume_skip = state_->spec.skip;
}

size_t DistributedSampler::global_position() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const auto& s = *state_;
  return std::min(s.spec.dataset_size, s.spec.skip + s.position * s.spec.num_replicas);
}

void DistributedSampler::set_global_position(size_t samples) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto& s = *state_;
  DTRAIN_CHECK_ARG(samples <= s.spec.dataset_size, "DistributedSampler::set_global_position: ",
                   samples, " samples is past the end of the epoch (dataset_size ",
                   s.spec.dataset_size, ")");
  s.spec.skip = samples;
  s.rebuild();
  s.position = 0;
  s.resume_at = 0;
  s.resume_skip = samples;
}

namespace {

void write_int(torch::serialize::OutputArchive& archive, const char* key, int64_t value) {
  archive.write(key, torch::tensor(value, torch::kLong), /*is_buffer=*/true);
}

int64_t read_int(torch::serialize::InputArchive& archive, const char* key) {
  torch::Tensor t;
  DTRAIN_CHECK_ARG(archive.try_read(key, t, /*is_buffer=*/true),
                   "DistributedSampler::load: the archive has no '", key,
                   "' (was it written by DistributedSampler::save?)");
  return t.item<int64_t>();
}

}  // namespace

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const auto& s = *state_;
  write_int(archive, "epoch", s.spec.epoch);
  write_int(archive, "position", static_cast<int64_t>(s.position));
  write_int(archive, "skip", static_cast<int64_t>(s.spec.skip));
  write_int(archive, "dataset_size", static_cast<int64_t>(s.spec.dataset_size));
  write_int(archive, "num_replicas", static_cast<int64_t>(s.spec.num_replicas));
  write_int(archive, "seed", s.spec.seed);
  write_int(archive, "shuffle", s.spec.shuffle);
  write_int(archive, "drop_last", s.spec.drop_last);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto& s = *state_;
  // A different configuration orders the samples differently: the saved
  // position would skip or repeat samples, so refuse it.
  auto same = [&](const char* key, int64_t mine) {
    const int64_t saved = read_int(archive, key);
    DTRAIN_CHECK_ARG(saved == mine, "DistributedSampler::load: the archive was saved with ", key,
                     " ", saved, " but this sampler has ", key, " ", mine);
  };
  same("dataset_size", static_cast<int64_t>(s.spec.dataset_size));
  same("num_replicas", static_cast<int64_t>(s.spec.num_replicas));
  same("seed", s.spec.seed);
  same("shuffle", s.spec.shuffle);
  same("drop_last", s.spec.drop_last);
  const int64_t epoch = read_int(archive, "epoch");
  const int64_t position = read_int(archive, "position");
  DTRAIN_CHECK_ARG(position >= 0, "DistributedSampler::load: negative position ", position);
  torch::Tensor skip_tensor;  // absent in archives of earlier versions
  const int64_t skip =
      archive.try_read("skip", skip_tensor, /*is_buffer=*/true) ? skip_tensor.item<int64_t>() : 0;
  DTRAIN_CHECK_ARG(skip >= 0 && static_cast<size_t>(skip) <= s.spec.dataset_size,
                   "DistributedSampler::load: skip ", skip, " is outside [0, dataset_size ",
                   s.spec.dataset_size, "]");
  s.spec.epoch = epoch;
  s.spec.skip = static_cast<size_t>(skip);
  s.resume_skip = s.spec.skip;
  s.rebuild();
  check_position(static_cast<size_t>(position), s.indices.size(), "load");
  s.position = static_cast<size_t>(position);
  s.resume_at = s.position;
}

size_t DistributedSampler::num_samples() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->indices.size();
}

size_t DistributedSampler::total_size() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->indices.size() * state_->spec.num_replicas;
}

size_t DistributedSampler::dataset_size() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->spec.dataset_size;
}

int DistributedSampler::rank() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int>(state_->spec.rank);
}

int DistributedSampler::num_replicas() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int>(state_->spec.num_replicas);
}

std::vector<size_t> DistributedSampler::indices() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->indices;
}

}  // namespace dtrain
