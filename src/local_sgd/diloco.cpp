// DiLoCo and Streaming DiLoCo (dtrain/local_sgd.h): each fragment's global
// values as one flat tensor, its pseudo-gradient averaged over the
// replicas (in the background for sync_delay inner steps), the outer
// optimizer stepped on the parameters holding the global values.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

#include "common/enforce.h"
#include "core/control_tensors.h"
#include "dtrain/distributed.h"
#include "dtrain/local_sgd.h"
#include "local_sgd/diloco_impl.h"
#include "local_sgd/flat.h"

namespace dtrain::local_sgd {
namespace {

using detail::copy_into;
using detail::flat_of;

constexpr const char* kWho = "DiLoCo";

std::unordered_set<const c10::TensorImpl*> params_of(const torch::optim::Optimizer& optimizer) {
  std::unordered_set<const c10::TensorImpl*> out;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) out.insert(p.unsafeGetTensorImpl());
  return out;
}

// Before anything else (the default group is looked up after).
const DiLoCoOptions& checked(const DiLoCoOptions& options, size_t fragment_count) {
  const int64_t h = options.sync_every();
  DTRAIN_CHECK_ARG(h >= 1, kWho, ": sync_every must be at least 1, got ", h);
  DTRAIN_CHECK_ARG(fragment_count >= 1, kWho, ": no fragment of parameters");
  DTRAIN_CHECK_ARG(static_cast<int64_t>(fragment_count) <= h, kWho, ": ", fragment_count,
                   " fragments cannot each sync at their own step of sync_every ", h);
  DTRAIN_CHECK_ARG(options.sync_delay() >= 0 && options.sync_delay() < h, kWho, ": sync_delay ",
                   options.sync_delay(), " must be in 0..sync_every - 1 (", h - 1,
                   "): a fragment's average must end before its next one starts");
  const double alpha = options.fragment_update_alpha();
  DTRAIN_CHECK_ARG(alpha >= 0 && alpha <= 1, kWho, ": fragment_update_alpha ", alpha, " must be in [0, 1]");
  return options;
}

}  // namespace

// The fragments hold each parameter once, and exactly the inner and outer
// optimizers' parameters.
void DiLoCo::Impl::check_partition() const {
  std::unordered_map<const c10::TensorImpl*, size_t> fragment_of;
  size_t total = 0;
  for (size_t i = 0; i < fragments.size(); ++i) {
    const auto& params = fragments[i].params;
    DTRAIN_CHECK_ARG(!params.empty(), kWho, ": fragment ", i, " holds no parameter");
    for (const auto& p : params) {
      DTRAIN_CHECK_ARG(p.defined(), kWho, ": fragment ", i, " holds an undefined tensor");
      DTRAIN_CHECK_ARG(p.scalar_type() == params[0].scalar_type() && p.device() == params[0].device(), kWho,
                       ": fragment ", i, " mixes ", params[0].scalar_type(), " on ", params[0].device(), " with ",
                       p.scalar_type(), " on ", p.device(), " (one dtype and device per fragment)");
      auto [it, fresh] = fragment_of.emplace(p.unsafeGetTensorImpl(), i);
      DTRAIN_CHECK_ARG(fresh, kWho, ": a parameter of shape ", p.sizes(), " is in fragment ", it->second,
                       " and in fragment ", i, ": the fragments must partition the parameters");
      ++total;
    }
  }
  for (const auto* which : {&inner, &outer}) {
    const auto held = params_of(*which);
    const char* name = which == &inner ? "inner" : "outer";
    size_t in_fragments = 0;
    for (const auto* p : held) in_fragments += fragment_of.count(p);
    DTRAIN_CHECK_ARG(in_fragments == held.size(), kWho, ": the ", name, " optimizer holds ",
                     held.size() - in_fragments, " parameters that no fragment holds (",
                     which == &inner ? "they would drift apart across replicas" : "it would step them with no "
                     "pseudo-gradient", "): the fragments must partition its parameters");
    DTRAIN_CHECK_ARG(in_fragments == total, kWho, ": the fragments hold ", total - in_fragments,
                     " parameters that the ", name, " optimizer does not: both optimizers must hold exactly "
                     "the fragments' parameters");
  }
}

// Every replica must sync the same fragments at the same steps: their
// options and fragment sizes are compared (a difference is named on every
// replica), then replica 0's values become everyone's.
void DiLoCo::Impl::agree_across_replicas() {
  int64_t total = 0, sizes = 0;
  for (const auto& f : fragments) {
    total += f.global.numel();
    sizes = sizes * 1000003 + f.global.numel();  // (the sizes in order, folded)
  }
  const std::vector<int64_t> mine{options.sync_every(), options.sync_delay(),
                                  static_cast<int64_t>(std::llround(options.fragment_update_alpha() * 1e9)),
                                  options.bf16_exchange() ? 1 : 0, static_cast<int64_t>(fragments.size()), total,
                                  sizes};
  const char* const what[] = {"sync_every",  "sync_delay", "fragment_update_alpha (x 1e9)", "bf16_exchange",
                              "fragments",   "elements",   "fragment sizes (folded)"};
  const auto rows = dtrain::detail::all_gather_control(*group, at::tensor(mine, at::kLong));
  for (int r = 1; r < group->size(); ++r)
    for (size_t i = 0; i < mine.size(); ++i) {
      const int64_t a = rows[0][static_cast<int64_t>(i)].item<int64_t>();
      const int64_t b = rows[r][static_cast<int64_t>(i)].item<int64_t>();
      DTRAIN_CHECK_ARG(a == b, kWho, ": the replicas differ: replica ", r, " has ", what[i], " ", b,
                       ", replica 0 has ", a, " (every replica must sync the same fragments at the same steps)");
    }
  if (group->size() == 1) return;
  for (auto& f : fragments) {
    group->broadcast(f.global, 0)->wait();
    copy_into(f.params, f.global);
  }
}

DiLoCo::DiLoCo(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
               torch::optim::Optimizer& outer, const DiLoCoOptions& options)
    : impl_(std::make_unique<Impl>(inner, outer, checked(options, fragments.size()))) {
  auto& s = *impl_;
  if (options.manager()) s.check_for_manager();
  DTRAIN_CHECK_ARG(!s.group || s.group->rank() >= 0, kWho, ": this rank is not a member of group '",
                   s.group ? s.group->name() : "", "'");
  const int64_t h = options.sync_every(), count = static_cast<int64_t>(fragments.size());
  at::NoGradGuard no_grad;
  for (int64_t i = 0; i < count; ++i) {
    Fragment f;
    f.params = std::move(fragments[i]);
    f.offset = (h * (i + 1)) / count;  // torchft's floor(H / F * (i + 1))
    s.fragments.push_back(std::move(f));
  }
  s.check_partition();
  for (auto& f : s.fragments) f.global = flat_of(f.params).clone();
  if (!options.manager()) s.agree_across_replicas();  // (with one: at every sync, and its first quorum's heal)
}

DiLoCo::~DiLoCo() {
  // Averages still in flight finish before their buffers go (bounded by the
  // group's timeout); their errors are not thrown from a destructor.
  for (auto& f : impl_->fragments)
    if (f.work) try {
        f.work->wait();
      } catch (const std::exception&) {
      }
}

// The pseudo-gradient, global minus own, divided by the replicas and
// summed over them in the background.
void DiLoCo::Impl::prepare(Fragment& f) {
  DTRAIN_ENFORCE(!f.work && !f.arrived);
  at::NoGradGuard no_grad;
  f.delta = f.global - flat_of(f.params);
  if (options.bf16_exchange()) f.delta = f.delta.to(at::kBFloat16);
  f.delta.div_(static_cast<double>(group->size()));
  peak_bytes = std::max<int64_t>(peak_bytes, static_cast<int64_t>(f.delta.nbytes()));
  f.work = group->all_reduce(f.delta, ReduceOp::SUM);
}

// The outer step: the parameters hold the global values and the averaged
// pseudo-gradient as their gradient (the others' gradients set aside), the
// outer optimizer steps them; the result is the new global, mixed with the
// replica's own values by fragment_update_alpha.
void DiLoCo::Impl::sync(Fragment& f) {
  DTRAIN_ENFORCE(f.work || f.arrived);  // prepared sync_delay steps ago (or loaded so)
  if (f.work) f.work->wait();
  f.work.reset();
  f.arrived = false;
  const at::Tensor average = f.delta.to(f.global.scalar_type());
  f.delta = at::Tensor();
  apply(f, average);
}

void DiLoCo::Impl::apply(Fragment& f, const at::Tensor& average) {
  at::NoGradGuard no_grad;
  const at::Tensor own = options.fragment_update_alpha() > 0 ? flat_of(f.params) : at::Tensor();
  std::unordered_set<const c10::TensorImpl*> mine;
  for (const auto& p : f.params) mine.insert(p.unsafeGetTensorImpl());
  std::vector<std::pair<at::Tensor, at::Tensor>> set_aside;
  for (auto& group_ : outer.param_groups())
    for (auto& p : group_.params())
      if (!mine.count(p.unsafeGetTensorImpl()) && p.grad().defined()) {
        set_aside.emplace_back(p, p.grad());
        p.mutable_grad() = at::Tensor();
      }
  copy_into(f.params, f.global);
  int64_t offset = 0;
  for (auto& p : f.params) {
    p.mutable_grad() = average.narrow(0, offset, p.numel()).view_as(p).clone();
    offset += p.numel();
  }
  outer.step();
  for (auto& p : f.params) p.mutable_grad() = at::Tensor();
  for (auto& [p, grad] : set_aside) p.mutable_grad() = grad;
  f.global.copy_(flat_of(f.params));
  if (own.defined()) copy_into(f.params, f.global.lerp(own, options.fragment_update_alpha()));
}

Fragment* DiLoCo::Impl::due_at(int64_t step) {
  for (auto& f : fragments)
    if (step >= f.offset && (step - f.offset) % options.sync_every() == 0) return &f;
  return nullptr;
}

void DiLoCo::step() {
  auto& s = *impl_;
  s.inner.step();
  if (s.options.manager()) return s.sync_in_quorum(++s.local_step);
  const int64_t step = ++s.local_step, h = s.options.sync_every(), delay = s.options.sync_delay();
  if (Fragment* due = s.due_at(step)) s.prepare(*due);  // (fragments sync at distinct steps)
  for (auto& f : s.fragments)
    if (step >= f.offset + delay && (step - f.offset - delay) % h == 0) s.sync(f);
}

int64_t DiLoCo::local_step() const { return impl_->local_step; }

std::vector<at::Tensor> DiLoCo::global_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& f : impl_->fragments) out.push_back(f.global);
  return out;
}

int64_t DiLoCo::peak_sync_bytes() const { return impl_->peak_bytes; }

}  // namespace dtrain::local_sgd
