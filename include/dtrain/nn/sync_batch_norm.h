#pragma once

// SyncBatchNorm (torch.nn.SyncBatchNorm, on every backend, CPU included):
// batch normalization whose batch statistics are those of the whole global
// batch, i.e. of every rank's batch together, instead of this rank's alone.
// Models trained with small per-rank batches need it.
//
//   auto net = torch::nn::Sequential(
//       torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3)),
//       dtrain::SyncBatchNorm2d(torch::nn::BatchNormOptions(16)),
//       torch::nn::ReLU());
//   dtrain::DistributedDataParallel ddp(net.ptr());
//
// In training, forward all-reduces one tensor per call holding each
// channel's sum and sum of squares and the element count (in double
// precision), and backward all-reduces the two gradient sums that the input
// gradient needs (only when the input requires a gradient). Both are
// collective: every rank of the group must run the same forward and
// backward, but ranks may hold batches of different sizes, including empty
// ones. Weight and bias gradients are this rank's share, as in PyTorch
// (DistributedDataParallel averages them). Running statistics follow
// BatchNorm (unbiased variance over the global batch, momentum or a
// cumulative average when momentum is unset) and stay identical on every
// rank. In eval mode with running statistics, or in a group of one rank,
// nothing is sent and the module is plain BatchNorm.
//
// Parameters and buffers have BatchNorm's names (weight, bias,
// running_mean, running_var, num_batches_tracked), so state dicts and
// checkpoints move between the two.

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>

#include "dtrain/process_group.h"

namespace dtrain {

// D: 1 accepts (N, C) and (N, C, L); 2 accepts (N, C, H, W); 3 accepts
// (N, C, D, H, W). Any other shape: InvalidArgument naming the module.
template <size_t D>
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl<D>> {
 public:
  // `group` null: the default group, looked up at each forward (so the
  // module may be built before init_process_group).
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                             std::shared_ptr<ProcessGroup> group = nullptr);

  torch::Tensor forward(const torch::Tensor& input);

  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  torch::nn::BatchNormOptions options;
  std::shared_ptr<ProcessGroup> group;
  torch::Tensor weight;
  torch::Tensor bias;
  torch::Tensor running_mean;
  torch::Tensor running_var;
  torch::Tensor num_batches_tracked;

 // A SyncBatchNorm holding `norm`'s own parameter and buffer tensors (by
  // their BatchNorm names) instead of fresh ones: what
  // convert_sync_batchnorm builds.
  static std::shared_ptr<SyncBatchNormImpl> adopting(const torch::nn::BatchNormOptions& options,
                                                     std::shared_ptr<ProcessGroup> group,
                                                     const torch::nn::Module& norm);

 private:
  struct Adopted {
    torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  };
  SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, std::shared_ptr<ProcessGroup> group,
                    std::shared_ptr<Adopted> adopted);
  // When set, the next reset() registers these tensors instead of fresh ones.
  std::shared_ptr<Adopted> adopted_;
};

extern template class SyncBatchNormImpl<1>;
extern template class SyncBatchNormImpl<2>;
extern template class SyncBatchNormImpl<3>;

TORCH_MODULE_IMPL(SyncBatchNorm1d, SyncBatchNormImpl<1>);
TORCH_MODULE_IMPL(SyncBatchNorm2d, SyncBatchNormImpl<2>);
TORCH_MODULE_IMPL(SyncBatchNorm3d, SyncBatchNormImpl<3>);

// torch.nn.SyncBatchNorm.convert_sync_batchnorm: returns `module` with every
// torch::nn::BatchNorm{1,2,3}d replaced by the SyncBatchNorm of the same
// dimension that shares its parameters, buffers (so an optimizer built on
// the old parameters keeps working) and training mode.
//  - A BatchNorm module: its SyncBatchNorm is returned.
//  - A torch::nn::Sequential: a new Sequential with the
//    same children in the same order and names, BatchNorms swapped.
//  - Any other module holding a BatchNorm somewhere below it: InvalidArgument
//    naming each such BatchNorm's path. A C++ module calls its members
//    directly in forward(), so a child swapped in its registry would be
//    bypassed silently; declare those as dtrain::SyncBatchNorm*d instead.
//  - A module without BatchNorms: returned unchanged.
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    const std::shared_ptr<torch::nn::Module>& module,
    std::shared_ptr<ProcessGroup> group = nullptr);

}  // namespace dtrain
