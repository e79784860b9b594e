// DiLoCo under a fault-tolerance manager (DiLoCoOptions::manager): each
// sync is one of the manager's steps, over whichever replicas the
// lighthouse's quorum holds at that sync.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <exception>
#include <vector>

#include "common/enforce.h"
#include "dtrain/ft/manager.h"
#include "dtrain/local_sgd.h"
#include "local_sgd/diloco_impl.h"
#include "local_sgd/flat.h"

namespace dtrain::local_sgd {
namespace {

using detail::copy_into;
using detail::flat_of;

constexpr const char* kDiLoCo = "DiLoCo";  // (kWho is diloco.cpp's, in the same unity unit)

// What every replica must agree on, sent beside each sync's average: each
// value's bits as 0s and 1s, whose means over the participants are all 0
// or 1 exactly when every participant has the same value (a mean between
// names a difference on every replica alike, with no rounding to fear).
struct Agreement {
  static constexpr int kValues = 5, kBits = 48;
  static constexpr const char* kNames[kValues] = {"sync_every", "fragments", "elements",
                                                  "fragment_update_alpha (x 1e9)", "bf16_exchange"};
  std::vector<int64_t> mine;

  // [contributes, bits of value 0, bits of value 1, ...] as doubles.
  at::Tensor to_send(bool contributes) const {
    std::vector<double> row{contributes ? 1.0 : 0.0};
    for (int64_t v : mine)
      for (int b = 0; b < kBits; ++b) row.push_back(static_cast<double>((v >> b) & 1));
    return at::tensor(row, at::kDouble);
  }

  // The first value the participants differ in, named with this replica's.
  void check(const at::Tensor& averaged, const std::string& quorum) const {
    const auto* a = averaged.data_ptr<double>();
    for (int i = 0; i < kValues; ++i)
      for (int b = 0; b < kBits; ++b) {
        const double mean = a[1 + i * kBits + b];
        DTRAIN_CHECK_ARG(mean < 1e-9 || mean > 1 - 1e-9, kDiLoCo, ": the replicas of quorum ", quorum, " differ in ",
                         kNames[i], " (this one has ", mine[i],
                         "): every replica must sync the same fragments at the same steps");
      }
  }
};

}  // namespace

void DiLoCo::Impl::check_for_manager() const {
  auto* m = options.manager();
  DTRAIN_CHECK_ARG(!options.group(), kDiLoCo, ": a manager and a group were both given: with a manager the replicas "
                   "are its quorum's (leave DiLoCoOptions::group unset)");
  DTRAIN_CHECK_ARG(!m->options().async_quorum(), kDiLoCo, ": the manager's quorum is asynchronous; DiLoCo needs "
                   "ManagerOptions().async_quorum(false), so that a replica heals before its pseudo-gradient is "
                   "taken (torchft refuses it too)");
  DTRAIN_CHECK_ARG(options.sync_delay() == 0, kDiLoCo, ": sync_delay ", options.sync_delay(), " with a manager: its "
                   "steps run one at a time, so a fragment's average cannot stay in flight across the next "
                   "fragment's sync (use sync_delay 0)");
  for (const auto& f : fragments)
    DTRAIN_CHECK_ARG(f.params.front().device().is_cpu(), kDiLoCo, ": a fragment on ", f.params.front().device(),
                     " with a manager, whose cross-replica groups take CPU tensors");
}

// One sync as the manager's step: the quorum (this replica may heal: then
// it holds a live peer's whole state, clock included, and every fragment
// goes back to its global values, so that the peer's progress is not
// counted twice), the average over the members that did not just heal,
// the vote, and the outer step or, when the step does not commit, the
// fragment back to its global values.
void DiLoCo::Impl::sync_in_quorum(int64_t step) {
  Fragment* f = due_at(step);
  if (!f) return;
  auto& manager = *options.manager();
  manager.start_quorum();
  const auto quorum = manager.quorum();
  at::NoGradGuard no_grad;
  if (quorum.healing) {
    for (auto& g : fragments) copy_into(g.params, g.global);
    f = due_at(local_step);  // the peer's clock
    DTRAIN_CHECK_ARG(f, kDiLoCo, ": healed from a peer at inner step ", local_step,
                     ", where no fragment syncs: the peer is not a DiLoCo replica of these options");
  }
  const bool contributes = quorum.participating && !quorum.healing;
  int64_t elements = 0;
  for (const auto& g : fragments) elements += g.global.numel();
  const Agreement agreement{{options.sync_every(), static_cast<int64_t>(fragments.size()), elements,
                             static_cast<int64_t>(std::llround(options.fragment_update_alpha() * 1e9)),
                             options.bf16_exchange() ? 1 : 0}};
  at::Tensor delta = f->global - flat_of(f->params);
  if (options.bf16_exchange()) delta = delta.to(at::kBFloat16);
  if (!contributes) delta.zero_();
  peak_bytes = std::max<int64_t>(peak_bytes, static_cast<int64_t>(delta.nbytes()));
  // The agreement first: replicas of other options may be about to send
  // other fragments.
  at::Tensor control = agreement.to_send(contributes);
  manager.allreduce(control);
  if (!manager.errored()) agreement.check(control, quorum.id);
  manager.allreduce(delta);  // the mean over the participants (a non-contributor's zeros among them)
  const double contributing = control.data_ptr<double>()[0];  // the fraction of participants that contributed
  if (!manager.should_commit() || contributing <= 0) {
    copy_into(f->params, f->global);  // the sync is dropped, with the steps since the last
    return;
  }
  at::Tensor average = delta.to(f->global.scalar_type());
  if (contributing != 1.0) average.div_(contributing);
  apply(*f, average);
}

}  // namespace dtrain::local_sgd
