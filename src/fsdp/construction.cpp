// ShardedConstruction: FullyShard units sharded the moment they are
// constructed, so building a model needs one unit's memory at a time.

#include <ATen/ATen.h>

#include <string>
#include <unordered_set>
#include <vector>

#include "common/cpu_memory.h"
#include "common/enforce.h"
#include "ddp/model_sync.h"
#include "dtrain/distributed.h"
#include "dtrain/fsdp.h"
#include "fsdp/flat_unit.h"

namespace dtrain {
namespace {

thread_local ShardedConstruction* current = nullptr;

bool below(const std::string& path, const std::string& root) {
  return path.size() > root.size() && path.compare(0, root.size(), root) == 0 && path[root.size()] == '.';
}

}  // namespace

ShardedConstruction::ShardedConstruction(std::shared_ptr<ProcessGroup> group)
    : group_(group ? std::move(group) : default_group()), outer_(current) {
  DTRAIN_CHECK_ARG(group_->rank() >= 0, "ShardedConstruction: this rank is not a member of group '",
                   group_->name(), "'");
  detail::return_large_blocks(32 << 20);  // as FullyShardedDataParallel does
  current = this;
}

ShardedConstruction::~ShardedConstruction() { current = outer_; }

namespace detail {

// The unit's own parameters, in the order FullyShardedDataParallel's unit
// discovery lists them: the module tree in pre-order, each parameter once,
// without the subtrees of units nested in it (already sharded).
ConstructionHook::ConstructionHook(FSDPModule& unit, torch::nn::Module& module) {
  if (current == nullptr) return;
  std::vector<std::string> nested;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::unordered_set<const c10::TensorImpl*> seen;
  auto take = [&](torch::nn::Module& owner, const std::string& path) {
    for (const auto& param : owner.named_parameters(/*recurse=*/false)) {
      if (!seen.insert(param.value().unsafeGetTensorImpl()).second) continue;
      params.push_back(param.value());
      names.push_back(path.empty() ? param.key() : path + "." + param.key());
    }
  };
  // The module itself is being constructed (not yet in a shared_ptr), so
  // its own parameters first, then its submodules in pre-order.
  take(module, "");
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    const std::string& path = item.key();
    bool inside = false;
    for (const auto& root : nested) inside = inside || path == root || below(path, root);
    if (inside) continue;
    if (dynamic_cast<FSDPModule*>(item.value().get()) != nullptr) {
      nested.push_back(path);
      continue;
    }
    take(*item.value(), path);
  }
  // Every rank must be building the same unit: checked before its values
  // are broadcast, so a difference is named instead of mismatching sizes.
  ddp::verify_same_model(*current->group(), names, params, "ShardedConstruction (a FullyShard unit)");
  if (params.empty()) return;
  unit.constructed_group_ = current->group();
  unit.constructed_ = std::make_shared<fsdp::FlatUnit>("", std::move(params), std::move(names),
                                                       *current->group());
}

void unwrapped_unit_called() {
  throw InvalidArgument(
      "FullyShard: this unit was sharded as it was constructed (ShardedConstruction), so its "
      "parameters hold no memory; wrap the model in a FullyShardedDataParallel over the same "
      "group before running it");
}

}  // namespace detail
}  // namespace dtrain
