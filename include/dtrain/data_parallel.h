#pragma once

// DataParallel for libtorch modules: PyTorch's nn.DataParallel, in one process.
//
//   auto net = std::make_shared<Net>();                  // Net : torch::nn::Cloneable<Net>
//   dtrain::DataParallel dp(net);                        // every CUDA device
//   dtrain::DataParallel cpu(net, dtrain::DataParallelOptions().cpu_replicas(2));
//   torch::optim::SGD opt(dp.parameters(), 0.01);        // the original module's parameters
//   auto loss = criterion(dp.forward(x), y);             // x split along dim 0, outputs gathered
//   loss.backward();                                     // net's .grad as for one forward on x
//   opt.step();
//
// Contract of forward(x):
// - x is split along `dim` into min(replicas, x.size(dim)) chunks whose sizes
//   differ by at most one (larger chunks first, like torch.tensor_split);
//   chunk i runs on replica i, all replicas in parallel threads; the outputs
//   are concatenated along `dim` on the output device (CPU in cpu mode).
//   A size of 0 along `dim` is an InvalidArgument. With one chunk the module
//   runs directly on the caller's thread.
// - Replica 0 is the wrapped module itself; the others are clone()s made at
//   construction, refreshed from the original before every forward. So the
//   module must derive from torch::nn::Cloneable (InvalidArgument otherwise)
//   unless there is only one replica.
// - Gradients of every replica arrive, summed, in the ORIGINAL parameters'
//   .grad: after backward the original module holds what one forward over
//   the whole batch would give (for modules without batch-dependent layers),
//   so an optimizer over dp.parameters() trains it.
// - Buffers follow PyTorch: replica 0 works on the original buffers, so its
//   updates (e.g. BatchNorm running statistics from chunk 0) are kept; the
//   other replicas get fresh copies every forward and their updates are
//   dropped. In training mode BatchNorm normalizes each chunk with that
//   chunk's statistics, as nn.DataParallel does.
// - cpu mode: replicas share the original parameter storage (no copies); each
//   replica thread runs ATen ops on ONE intra-op thread, and backward runs the
//   replicas' parts of the graph in parallel on the same threads. The caller's
//   own intra-op thread count is left as it is. See docs/data-parallel.md.
// - Not thread-safe: one forward (and its backward) at a time per object.
//   forward takes and returns one tensor.

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/arg.h"

namespace dtrain {

struct DataParallelOptions {
  // CUDA device indices to replicate on; empty: every visible CUDA device.
  // The module's parameters must already be on device_ids[0]. An index may
  // repeat: those replicas share the device. Each replica runs on the
  // caller's current stream of its device.
  DTRAIN_ARG(std::vector<int64_t>, device_ids) = {};
  // CUDA device index the outputs are gathered on (-1: the CPU); unset:
  // device_ids[0].
  DTRAIN_ARG(std::optional<int64_t>, output_device) = std::nullopt;
  // The dimension inputs are split along and outputs gathered along.
  DTRAIN_ARG(int64_t, dim) = 0;
  // Run this many replicas on CPU threads instead of on CUDA devices
  // (exclusive with device_ids and output_device).
  DTRAIN_ARG(std::optional<int64_t>, cpu_replicas) = std::nullopt;
};

namespace detail {

// What the engine needs to know about the concrete module type, as plain
// functions so that the engine itself is not a template.
struct ModuleOps {
  bool (*is_instance)(const torch::nn::Module& module);
  at::Tensor (*forward)(torch::nn::Module& module, const at::Tensor& input);
};

// The non-template engine behind DataParallel (src/dp/).
class DataParallelCore {
 public:
  DataParallelCore(std::shared_ptr<torch::nn::Module> module, const DataParallelOptions& options,
                   ModuleOps ops);
  ~DataParallelCore();
  DataParallelCore(const DataParallelCore&) = delete;
  DataParallelCore& operator=(const DataParallelCore&) = delete;

  at::Tensor forward(const at::Tensor& input);
  // One entry per replica: CUDA devices, or kCPU repeated cpu_replicas times.
  const std::vector<c10::Device>& devices() const;
  c10::Device output_device() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail

template <typename ModuleType>
class DataParallel : public torch::nn::Module {
 public:
  explicit DataParallel(std::shared_ptr<ModuleType> module,
                        const DataParallelOptions& options = DataParallelOptions())
      : module_(register_module("module", std::move(module))),
        core_(std::make_unique<detail::DataParallelCore>(
            module_, options, detail::ModuleOps{&is_instance, &call_forward})) {}

  template <typename Impl>
  explicit DataParallel(torch::nn::ModuleHolder<Impl> holder,
                        const DataParallelOptions& options = DataParallelOptions())
      : DataParallel(holder.ptr(), options) {}

  // Scatter, parallel forward on the replicas, gather (see the contract above).
  at::Tensor forward(const at::Tensor& input) { return core_->forward(input); }

  const std::shared_ptr<ModuleType>& module() const { return module_; }
  const std::vector<c10::Device>& devices() const { return core_->devices(); }
  c10::Device output_device() const { return core_->output_device(); }

 private:
  static bool is_instance(const torch::nn::Module& m) {
    return dynamic_cast<const ModuleType*>(&m) != nullptr;
  }
  static at::Tensor call_forward(torch::nn::Module& m, const at::Tensor& input) {
    static_assert(std::is_convertible_v<decltype(std::declval<ModuleType&>().forward(input)),
                                        at::Tensor>,
                  "DataParallel needs a module whose forward(Tensor) returns a Tensor");
    // dynamic_cast: torch::nn::Cloneable derives virtually from Module.
    return dynamic_cast<ModuleType&>(m).forward(input);
  }

  std::shared_ptr<ModuleType> module_;
  std::unique_ptr<detail::DataParallelCore> core_;
};

template <typename ModuleType>
DataParallel(std::shared_ptr<ModuleType>) -> DataParallel<ModuleType>;
template <typename ModuleType>
DataParallel(std::shared_ptr<ModuleType>, const DataParallelOptions&) -> DataParallel<ModuleType>;
template <typename Impl>
DataParallel(torch::nn::ModuleHolder<Impl>) -> DataParallel<Impl>;
template <typename Impl>
DataParallel(torch::nn::ModuleHolder<Impl>, const DataParallelOptions&) -> DataParallel<Impl>;

}  // namespace dtrain
