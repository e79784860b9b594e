#pragma once

// ZeroRedundancyOptimizer (ZeRO stage 1; torch.distributed.optim's name):
// the optimizer's state is partitioned across the ranks of a group, so each
// rank holds the state of 1/N of the parameters instead of all of it (Adam:
// two tensors the size of the model per rank become 2/N).
//
//   dtrain::DistributedDataParallel ddp(net);
//   dtrain::ZeroRedundancyOptimizer opt(ddp.parameters(), [](std::vector<torch::Tensor> shard) {
//     return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
//   });
//   ... loss.backward(); opt.step();   // gradients already averaged by DDP
//
// How it works. The parameters, in order, form one flat space of N
// elements, cut into `size()` equal slices of ceil(N / size()) (the last may
// be shorter): the partition is balanced to within one element, and a
// parameter may span two ranks. Each rank keeps its slice as one tensor and
// gives it to the optimizer the factory builds (any torch::optim optimizer),
// so that optimizer's state covers only the slice. step() copies the slice's
// current values and gradients in, steps the local optimizer, then
// all-gathers the updated slices (all_gather_into_tensor) into every
// rank's parameters, which are views of one flat buffer from construction
// on (the same tensors, set_data()'d, so autograd and DDP see no change). For element-wise optimizers (SGD with momentum, Adam,
// AdamW, Adagrad, RMSprop) the parameters equal those of the same optimizer
// over all parameters on every rank.
//
// It is a torch::optim::Optimizer over all the parameters (one parameter
// group), so zero_grad() and learning-rate schedulers work on it: step()
// hands the group's options (lr, ...) to the local optimizer first.
// Requirements (InvalidArgument otherwise): at least one parameter; all of
// one dtype and device, contiguous; every rank of the group builds it with
// the same parameters in the same order. A parameter without a gradient in
// a step counts as a zero gradient (optimizers with momentum still move it;
// PyTorch's ZeroRedundancyOptimizer skips it). step() is collective.

#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <string>
#include <memory>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

struct ZeroRedundancyOptions {
  // The group the state is partitioned over; null: the default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
};

class ZeroRedundancyOptimizer : public torch::optim::Optimizer {
 public:
  // Builds the local optimizer over this rank's slice (one tensor).
  using Factory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> shard)>;

  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, const Factory& make_local,
                          ZeroRedundancyOptions options = ZeroRedundancyOptions());
  ~ZeroRedundancyOptimizer() override;

  // Collective: every rank of the group calls it.
  torch::Tensor step(LossClosure closure = nullptr) override;

  // The optimizer over this rank's slice (its state is this rank's share).
  torch::optim::Optimizer& local_optimizer();
  // Collective (PyTorch's consolidate_state_dict + state_dict on `to_rank`):
  // the whole optimizer state gathered onto `to_rank`, as CPU tensors:
  // "<i>/<field>" shaped like parameter i (Adam/AdamW: exp_avg, exp_avg_sq,
  // max_exp_avg_sq; SGD: momentum_buffer) and "step" for Adam's count. The
  // other ranks get an empty map. State not created yet is created as the
  // first step would. Adam, AdamW and SGD (InvalidArgument otherwise).
  std::map<std::string, torch::Tensor> consolidate_state_dict(int to_rank = 0);
  // This rank's slice of the flat parameter space: [shard_begin, shard_end).
  int64_t shard_begin() const { return begin_; }
  int64_t shard_end() const { return end_; }
  int64_t numel() const { return total_; }

 private:
  struct Piece {  // the part of one parameter inside this rank's slice
    size_t param;
    int64_t param_offset, shard_offset, length;
  };
  struct Parts {  // made before the base class: it takes the local optimizer's options
    std::shared_ptr<ProcessGroup> group;
    torch::Tensor flat, shard;
    std::unique_ptr<torch::optim::Optimizer> local;
  };
  static Parts prepare(const std::vector<torch::Tensor>& params, const Factory& make_local,
                       const ZeroRedundancyOptions& options);
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, Parts parts);

  std::shared_ptr<ProcessGroup> group_;
  torch::Tensor shard_;      // this rank's slice of flat_ (padded to the slice length)
  torch::Tensor flat_;       // every rank's slice; the parameters are views of it
  std::unique_ptr<torch::optim::Optimizer> local_;
  std::vector<Piece> pieces_;
  int64_t total_ = 0, slice_ = 0, begin_ = 0, end_ = 0;
};

}  // namespace dtrain
