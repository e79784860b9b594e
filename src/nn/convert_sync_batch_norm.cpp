// convert_sync_batchnorm: a BatchNorm becomes a SyncBatchNorm sharing its
// tensors; a Sequential is rebuilt around its swapped children; BatchNorms
// inside any other module cannot be swapped (its forward() calls its
// members, not its registry) and are named in the error.

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <optional>

#include "common/enforce.h"
#include "dtrain/errors.h"
#include "dtrain/nn/sync_batch_norm.h"

namespace dtrain {
namespace {

using torch::nn::AnyModule;
using torch::nn::Module;

// The SyncBatchNorm standing in for `module` when it is a BatchNorm.
std::optional<AnyModule> swapped_norm(const std::shared_ptr<Module>& module,
                                      const std::shared_ptr<ProcessGroup>& group) {
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(module))
    return AnyModule(SyncBatchNormImpl<1>::adopting(bn->options, group, *bn));
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(module))
    return AnyModule(SyncBatchNormImpl<2>::adopting(bn->options, group, *bn));
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(module))
    return AnyModule(SyncBatchNormImpl<3>::adopting(bn->options, group, *bn));
  return std::nullopt;
}

bool is_batch_norm(const Module& module) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module);
}

// Appends the path of every BatchNorm below `module` (at `path`) to `stuck`.
void find_stuck(const Module& module, const std::string& path, std::vector<std::string>& stuck) {
  for (const auto& item : module.named_modules(path, /*include_self=*/false))
    if (is_batch_norm(*item.value())) stuck.push_back(item.key());
}

// A Sequential with the same children, BatchNorms swapped; null when it
// holds none. (A Sequential cannot hold a Sequential: AnyModule refuses its
// templated forward, so its children are leaves or custom modules.)
std::shared_ptr<Module> rebuilt(const torch::nn::SequentialImpl& sequential,
                                const std::shared_ptr<ProcessGroup>& group,
                                std::vector<std::string>& stuck) {
  const auto names = sequential.named_children().keys();
  auto out = std::make_shared<torch::nn::SequentialImpl>();
  bool changed = false;
  size_t i = 0;
  for (const auto& child : sequential) {
    const auto& name = names.at(i++);
    auto norm = swapped_norm(child.ptr(), group);
    if (!norm) find_stuck(*child.ptr(), name, stuck);
    changed = changed || norm.has_value();
    out->push_back(name, norm ? std::move(*norm) : child);
  }
  if (!changed) return nullptr;
  out->train(sequential.is_training());
  return out;
}

}  // namespace

std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    const std::shared_ptr<torch::nn::Module>& module, std::shared_ptr<ProcessGroup> group) {
  if (!module) throw InvalidArgument("convert_sync_batchnorm: the module is null");
  if (auto norm = swapped_norm(module, group)) return norm->ptr();
  std::vector<std::string> stuck;
  std::shared_ptr<Module> result;
  if (auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module))
    result = rebuilt(*sequential, group, stuck);
  else
    find_stuck(*module, "", stuck);
  if (!stuck.empty()) {
    throw InvalidArgument(detail::cat(
        "convert_sync_batchnorm: cannot swap the BatchNorm", stuck.size() > 1 ? "s" : "", " at ",
        detail::join(stuck), ": ", stuck.size() > 1 ? "they are" : "it is",
        " inside a custom module, whose forward() calls its members directly, so a swapped "
        "child would be bypassed. Declare ", stuck.size() > 1 ? "them" : "it",
        " as dtrain::SyncBatchNorm1d/2d/3d, or hold ", stuck.size() > 1 ? "them" : "it",
        " in a torch::nn::Sequential"));
  }
  return result ? result : module;
}

}  // namespace dtrain
