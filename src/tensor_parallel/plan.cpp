// parallelize_module (tensor_parallel.h): a Sequential rebuilt with the
// tensor-parallel forms of the children a plan names.

#include <torch/torch.h>

#include <algorithm>
#include <string>

#include "common/enforce.h"
#include "dtrain/tensor_parallel.h"
#include "tensor_parallel/group.h"

namespace dtrain::tensor_parallel {
namespace {

const char* kWhat = "parallelize_module";

std::string style_name(const ParallelStyle& style) {
  if (std::holds_alternative<ColwiseParallel>(style)) return "ColwiseParallel";
  if (std::holds_alternative<RowwiseParallel>(style)) return "RowwiseParallel";
  return "SequenceParallel";
}

// `child` (at `path`) in the form `style` gives it.
torch::nn::AnyModule parallel_form(const std::string& path, const torch::nn::AnyModule& child,
                                   const ParallelStyle& style, const std::shared_ptr<ProcessGroup>& group) {
  const auto module = child.ptr();
  if (std::holds_alternative<SequenceParallel>(style)) {
    mark_sequence_parallel(*module, group);
    return child;
  }
  auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(module);
  auto embedding = std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(module);
  if (const auto* col = std::get_if<ColwiseParallel>(&style)) {
    DTRAIN_CHECK_ARG(linear, kWhat, ": '", path, "' is a ", module->name(),
                     "; ColwiseParallel takes a torch::nn::Linear");
    return torch::nn::AnyModule(ColumnParallelLinear(
        torch::nn::Linear(linear), ParallelLinearOptions().group(group).input_layout(col->input_layouts())
                                       .output_layout(col->output_layouts())));
  }
  const auto& row = std::get<RowwiseParallel>(style);
  const auto options = ParallelLinearOptions().group(group).input_layout(row.input_layouts())
                           .output_layout(row.output_layouts());
  if (embedding) return torch::nn::AnyModule(VocabParallelEmbedding(torch::nn::Embedding(embedding), options));
  DTRAIN_CHECK_ARG(linear, kWhat, ": '", path, "' is a ", module->name(),
                   "; RowwiseParallel takes a torch::nn::Linear or a torch::nn::Embedding");
  return torch::nn::AnyModule(RowParallelLinear(torch::nn::Linear(linear), options));
}

}  // namespace

torch::nn::Sequential parallelize_module(const torch::nn::Sequential& module,
                                         const std::shared_ptr<ProcessGroup>& group,
                                         const ParallelizePlan& plan) {
  auto g = detail::group_or_default(group, kWhat);
  const auto names = module->named_children().keys();
  for (const auto& [path, style] : plan)
    DTRAIN_CHECK_ARG(std::find(names.begin(), names.end(), path) != names.end(), kWhat, ": the plan's ",
                     style_name(style), " entry '", path, "' names no child of the Sequential");
  torch::nn::Sequential out;
  size_t i = 0;
  for (const auto& child : *module) {
    const std::string name = names.at(i++);
    auto style = plan.find(name);
    // What the plan leaves out is shared.
    out->push_back(std::string(name), style == plan.end() ? torch::nn::AnyModule(child)
                                                          : parallel_form(name, child, style->second, g));
  }
  return out;
}

}  // namespace dtrain::tensor_parallel
