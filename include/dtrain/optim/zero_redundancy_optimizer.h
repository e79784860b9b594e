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
//
// ZeRO-2 (gradients sharded as well): build DDP with
// DDPOptions().shard_gradients(true) and this optimizer over the DDP:
//
//   dtrain::DistributedDataParallel ddp(net, dtrain::DDPOptions().shard_gradients(true));
//   dtrain::ZeroRedundancyOptimizer opt(ddp, [](std::vector<torch::Tensor> shard) {
//     return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
//   });
//
// DDP reduce-scatters each gradient bucket, so a rank receives only its
// share of the average and no parameter's .grad is filled. The partition
// then follows DDP's buckets: each bucket is cut into size() equal slices,
// this rank steps on its slice of every bucket (the factory gets one tensor
// per bucket) and step() all-gathers each bucket's slices. The share a
// synchronized backward leaves is used by the next step(); more
// synchronized backwards before it add to it; after step() the next
// backward starts from zero (zero_grad() is not needed, and harmless).
// Results equal ZeRO-1's and plain DDP's with the same optimizer.

#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <string>
#include <memory>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

template <typename ModuleType>
class DistributedDataParallel;
namespace detail {
class DDPCore;
}
namespace ddp {
struct ShardedGradients;
}

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
  // ZeRO-2: over a DDP built with DDPOptions().shard_gradients(true); the
  // group is the DDP's. InvalidArgument for any other DDP.
  template <typename ModuleType>
  ZeroRedundancyOptimizer(DistributedDataParallel<ModuleType>& ddp, const Factory& make_local)
      : ZeroRedundancyOptimizer(ddp.engine(), make_local) {}
  ZeroRedundancyOptimizer(detail::DDPCore& ddp, const Factory& make_local);
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
  // ZeRO-1: this rank's slice of the flat parameter space, [shard_begin,
  // shard_end). Over a sharded DDP (one slice per bucket) InvalidArgument.
  int64_t shard_begin() const;
  int64_t shard_end() const;
  int64_t numel() const { return total_; }

  // The part of one parameter inside this rank's share: elements
  // [param_offset, param_offset + length) of parameter `param` (flattened)
  // are elements [shard_offset, shard_offset + length) of the local
  // optimizer's tensor number `shard`. A parameter has at most one.
  struct Piece {
    size_t param;
    int64_t param_offset;
    size_t shard;
    int64_t shard_offset, length;
  };
  const std::vector<Piece>& pieces() const { return pieces_; }

 private:
  // A stretch of the flat buffer cut into size() slices of `slice`
  // elements: ZeRO-1 has one, ZeRO-2 one per DDP bucket. Segment s starts
  // at flat element size() * shard_offset; this rank's slice of it is
  // local tensor s.
  struct Segment {
    int64_t shard_offset, slice;
  };
  struct Parts {  // made before the base class: it takes the local optimizer's options
    std::shared_ptr<ProcessGroup> group;
    std::vector<Segment> segments;
    std::vector<int64_t> param_offsets;  // where each parameter starts in `flat`
    torch::Tensor flat;
    std::vector<torch::Tensor> shards;
    std::unique_ptr<torch::optim::Optimizer> local;
    std::shared_ptr<ddp::ShardedGradients> link;
  };
  static Parts prepare(const std::vector<torch::Tensor>& params, const Factory& make_local,
                       const ZeroRedundancyOptions& options);
  static Parts prepare_sharded(detail::DDPCore& ddp, const Factory& make_local);
  static void finish_parts(Parts& parts, const std::vector<torch::Tensor>& params,
                           const Factory& make_local);
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, Parts parts);
  void gradients_in();
  void gather_updated();

  std::shared_ptr<ProcessGroup> group_;
  std::vector<Segment> segments_;
  std::vector<int64_t> param_offsets_;
  torch::Tensor flat_;                // every rank's slices; the parameters are views of it
  std::vector<torch::Tensor> shards_;  // this rank's slice of each segment (views of flat_)
  std::unique_ptr<torch::optim::Optimizer> local_;
  std::shared_ptr<ddp::ShardedGradients> link_;  // ZeRO-2: DDP's gradient shares
  std::vector<Piece> pieces_;
  int64_t total_ = 0;
};

}  // namespace dtrain
