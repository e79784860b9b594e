#pragma once

// DataParallel's replicas of the wrapped module: replica 0 is the module
// itself, replicas 1..n-1 are clone()s made once, at construction.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "common/torch_compat.h"
#include "dtrain/data_parallel.h"

namespace dtrain::dp {

class ReplicaSet {
 public:
  // Clones `module` onto devices[1..]. Throws InvalidArgument when the
  // module is not on devices[0], and naming the module when it cannot be cloned (not a torch::nn::Cloneable) or when the
  // clone differs from it. The global CPU random generator is left as it was
  // (Cloneable::clone re-runs reset(), which draws initial values).
  ReplicaSet(std::shared_ptr<torch::nn::Module> module, const std::vector<c10::Device>& devices,
             detail::ModuleOps ops);

  size_t size() const { return modules_.size(); }
  torch::nn::Module& module(size_t i) { return *modules_[i]; }
  const torch::nn::Module& original() const { return *modules_[0]; }
  at::Tensor forward(size_t i, const at::Tensor& input) { return ops_.forward(*modules_[i], input); }

  // Replica i's parameters / buffers, in the original's parameters() /
  // buffers() order. Index 0 is read from the module on every call (it may
  // have been changed); the clones' lists are fixed.
  std::vector<at::Tensor> params(size_t i) const;
  std::vector<at::Tensor> buffers(size_t i) const;

  // Throws InvalidArgument unless every parameter and buffer of the original
  // is on `device`, and unless it still has as many parameters and buffers
  // as when it was cloned.
  void check_original(c10::Device device) const;

  // For replicas 1..count-1: train/eval flags of every submodule as in the
  // original, and buffers replaced by fresh copies of the original's (so the
  // replicas' own updates never reach the original, and graphs from earlier
  // forwards keep the tensors they saved).
  void refresh_state(size_t count);

  // For replicas 1..count-1: each parameter takes the original's values
  // (its very storage with share_storage, on CPU; else a fresh copy on the
  // replica's device) and, when the original requires grad, a grad_fn that
  // sums what all replicas send it and passes the sum on to the original:
  // gradients through a replica's parameter reach the original parameter as
  // through an ordinary copy.
  void link_params(size_t count, bool share_storage);

 private:
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::vector<std::vector<at::Tensor>> params_, buffers_;  // clones only; [0] unused
  std::vector<std::vector<std::shared_ptr<torch::nn::Module>>> submodules_;
  std::vector<compat::NodePtr> links_;  // per parameter; null: none
  detail::ModuleOps ops_;
};

}  // namespace dtrain::dp
