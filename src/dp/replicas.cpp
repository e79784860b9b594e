// ReplicaSet: cloning the wrapped module and keeping the clones in step with it.

#include "dp/replicas.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "common/enforce.h"

namespace dtrain::dp {

namespace {

// The grad_fn of replicas' parameter copies, one per original parameter,
// shared by the replicas: sums the gradients of the replicas that used the
// parameter (in replica order, so deterministically) on the original's
// device and passes the sum to the original's AccumulateGrad.
struct ReduceToOrigin : torch::autograd::Node {
  explicit ReduceToOrigin(c10::Device origin) : origin(origin) {}
  std::string name() const override { return "dtrain::DataParallelReduceToOrigin"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor total;
    for (const auto& g : grads) {
      if (!g.defined()) continue;  // a replica that did not use the parameter
      auto here = g.to(origin);
      total = total.defined() ? total + here : here;
    }
    return {total};
  }
  c10::Device origin;
};

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// Cloneable::clone() builds the copy through reset(), which draws fresh
// initial values from the default CPU generator; restore its state so that
// wrapping a module does not change the program's random stream.
std::shared_ptr<torch::nn::Module> clone_keeping_rng(const torch::nn::Module& module,
                                                     c10::Device device) {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  struct Restore {
    at::Generator& gen;
    const at::Tensor& state;
    ~Restore() {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  } restore{gen, state};
  return module.clone(device);
}

void check_same_structure(const torch::nn::Module& original, const torch::nn::Module& copy) {
  const auto a = original.named_parameters(), b = copy.named_parameters();
  DTRAIN_CHECK_ARG(a.size() == b.size(), "DataParallel: the clone of ", original.name(), " has ",
                   b.size(), " parameters, the module ", a.size(),
                   "; its reset() must register every parameter");
  for (size_t i = 0; i < a.size(); ++i)
    DTRAIN_CHECK_ARG(a[i].key() == b[i].key() && a[i].value().sizes() == b[i].value().sizes(),
                     "DataParallel: the clone of ", original.name(), " differs at parameter #", i,
                     ": '", b[i].key(), "' ", b[i].value().sizes(), " instead of '", a[i].key(),
                     "' ", a[i].value().sizes());
  DTRAIN_CHECK_ARG(original.named_buffers().size() == copy.named_buffers().size(),
                   "DataParallel: the clone of ", original.name(), " has ",
                   copy.named_buffers().size(), " buffers, the module ",
                   original.named_buffers().size(), "; its reset() must register every buffer");
}

}  // namespace

ReplicaSet::ReplicaSet(std::shared_ptr<torch::nn::Module> module,
                       const std::vector<c10::Device>& devices, detail::ModuleOps ops)
    : ops_(ops) {
  DTRAIN_CHECK_ARG(module != nullptr, "DataParallel: the module is null");
  modules_.push_back(std::move(module));
  params_.emplace_back();
  buffers_.emplace_back();
  submodules_.emplace_back();
  links_.resize(modules_[0]->parameters().size());
  const auto& original = *modules_[0];
  check_original(devices[0]);  // before cloning from it
  for (size_t i = 1; i < devices.size(); ++i) {
    std::shared_ptr<torch::nn::Module> copy;
    try {
      copy = clone_keeping_rng(original, devices[i]);
    } catch (const c10::Error& e) {
      const std::string why = first_line(e.what_without_backtrace());
      const auto missing = why.find("clone() has not been implemented");
      // libtorch names the module (maybe a submodule) that lacks clone().
      DTRAIN_CHECK_ARG(missing == std::string::npos, "DataParallel: cannot replicate ",
                       original.name(), " for ", devices.size(), " replicas: ",
                       why.substr(missing, why.find(". ", missing) - missing), ". Derive ",
                       original.name(), " from torch::nn::Cloneable<", original.name(),
                       "> instead of torch::nn::Module (its submodules too) and create its "
                       "parameters, buffers and submodules in reset(); with a single replica no "
                       "clone is needed");
      throw InvalidArgument(detail::cat("DataParallel: cloning ", original.name(), " failed: ", why));
    }
    DTRAIN_CHECK_ARG(ops_.is_instance(*copy), "DataParallel: clone() of ", original.name(),
                     " returned a ", copy->name(), "; it must return the module's own type");
    check_same_structure(original, *copy);
    params_.push_back(copy->parameters());
    for (auto& p : params_.back()) p.detach_();  // unlinked until link_params
    buffers_.push_back(copy->buffers());
    submodules_.push_back(copy->modules());
    modules_.push_back(std::move(copy));
  }
}

std::vector<at::Tensor> ReplicaSet::params(size_t i) const {
  return i == 0 ? modules_[0]->parameters() : params_[i];
}

std::vector<at::Tensor> ReplicaSet::buffers(size_t i) const {
  return i == 0 ? modules_[0]->buffers() : buffers_[i];
}

void ReplicaSet::check_original(c10::Device device) const {
  const auto& m = *modules_[0];
  auto check = [&](const std::string& name, const at::Tensor& t) {
    DTRAIN_CHECK_ARG(!t.defined() || t.device() == device, "DataParallel: the module's parameters "
                     "and buffers must be on ", device, ", where replica 0 runs, but '", name,
                     "' is on ", t.device());
  };
  const auto params = m.named_parameters(), buffers = m.named_buffers();
  for (const auto& p : params) check(p.key(), p.value());
  for (const auto& b : buffers) check(b.key(), b.value());
  if (modules_.size() > 1)
    DTRAIN_CHECK_ARG(params.size() == params_[1].size() && buffers.size() == buffers_[1].size(),
                     "DataParallel: ", m.name(), " now has ", params.size(), " parameters and ",
                     buffers.size(), " buffers, its replicas ", params_[1].size(), " and ",
                     buffers_[1].size(), "; wrap the changed module in a new DataParallel");
}

void ReplicaSet::refresh_state(size_t count) {
  at::NoGradGuard no_grad;
  const auto original_modules = modules_[0]->modules();
  const auto original_buffers = modules_[0]->buffers();
  for (size_t i = 1; i < count; ++i) {
    // train() recurses into children, so set the flags top-down (modules()
    // is in pre-order) and the deepest setting wins, as in the original.
    auto& mods = submodules_[i];
    DTRAIN_ENFORCE_EQ(mods.size(), original_modules.size());
    for (size_t m = 0; m < mods.size(); ++m)
      if (mods[m]->is_training() != original_modules[m]->is_training())
        mods[m]->train(original_modules[m]->is_training());
    // Fresh storage rather than copy_(): an in-place copy would bump the
    // version of tensors that an earlier forward's graph may have saved.
    for (size_t b = 0; b < original_buffers.size(); ++b)
      if (original_buffers[b].defined() && buffers_[i][b].defined())
        buffers_[i][b].set_data(original_buffers[b].to(buffers_[i][b].device(), /*non_blocking=*/false,
                                                       /*copy=*/true));
  }
}

void ReplicaSet::link_params(size_t count, bool share_storage) {
  const auto original = modules_[0]->parameters();
  for (size_t j = 0; j < original.size(); ++j) {
    // The link lasts across forwards; it is remade only when the original's
    // gradient destination changed (requires_grad toggled, tensor replaced),
    // since unlinking (detach_) a tensor that an earlier, still unused graph
    // saved would break that graph.
    const torch::autograd::Edge target = original[j].requires_grad()
                                              ? torch::autograd::impl::gradient_edge(original[j])
                                              : torch::autograd::Edge();
    auto& link = links_[j];
    const bool current = link ? target.is_valid() && link->next_edge(0) == target : !target.is_valid();
    if (!current) {
      link = nullptr;
      if (target.is_valid()) {
        link = compat::make_node<ReduceToOrigin>(original[j].device());
        link->set_next_edges({target});
      }
      for (size_t i = 1; i < modules_.size(); ++i) {
        {
          at::NoGradGuard no_grad;
          params_[i][j].detach_();
        }
        if (link) torch::autograd::set_history(params_[i][j], link);
      }
    }
    at::NoGradGuard no_grad;
    for (size_t i = 1; i < count; ++i) {
      at::Tensor& p = params_[i][j];  // shares its TensorImpl with the clone's field
      // set_data: the clone's field must keep its TensorImpl.
      p.set_data(share_storage ? original[j].detach()
                               : original[j].detach().to(p.device(), /*non_blocking=*/false,
                                                         /*copy=*/true));
    }
  }
}

}  // namespace dtrain::dp
