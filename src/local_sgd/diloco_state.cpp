// checkpoint::add_diloco (dtrain/local_sgd.h): DiLoCo's clock, global
// values and unapplied averages as checkpoint entries.

#include <ATen/ATen.h>

#include "checkpoint/state/state_entries.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/local_sgd.h"
#include "local_sgd/diloco_impl.h"

namespace dtrain::checkpoint {

void add_diloco(DistributedState& state, local_sgd::DiLoCo& diloco, const std::string& prefix) {
  auto* s = diloco.impl_.get();
  const std::string base = prefix + "diloco/";
  const auto step = at::zeros({1}, at::kLong);
  const int64_t count = static_cast<int64_t>(s->fragments.size());
  const auto arrived = at::zeros({count}, at::kLong);
  std::vector<at::Tensor> pending;
  const auto exchange = s->options.bf16_exchange() ? at::kBFloat16 : at::ScalarType::Undefined;
  for (int64_t i = 0; i < count; ++i) {
    const auto& global = s->fragments[i].global;
    pending.push_back(at::zeros({global.numel()}, global.options().dtype(
                                                      exchange == at::ScalarType::Undefined ? global.scalar_type() : exchange)));
    detail::add_replicated(state, base + "global/" + std::to_string(i), global);
    detail::add_replicated(state, base + "pending/" + std::to_string(i), pending.back());
  }
  detail::add_replicated(state, base + "step", step);
  detail::add_replicated(state, base + "arrived", arrived);
  // An average in flight is waited for (bounded by the group's timeout) and
  // kept as arrived: the sync that applies it finds it there.
  state.before_save.push_back([s, step, arrived, pending] {
    step[0] = s->local_step;
    for (size_t i = 0; i < s->fragments.size(); ++i) {
      auto& f = s->fragments[i];
      if (f.work) {
        f.work->wait();
        f.work.reset();
        f.arrived = true;
      }
      arrived[static_cast<int64_t>(i)] = f.arrived ? 1 : 0;
      if (f.arrived) pending[i].copy_(f.delta);
    }
  });
  state.after_load.push_back([s, step, arrived, pending] {
    const int64_t loaded = step[0].item<int64_t>();
    DTRAIN_CHECK_ARG(loaded >= 0, "checkpoint: DiLoCo's step ", loaded, " in the checkpoint is negative");
    for (size_t i = 0; i < s->fragments.size(); ++i) {
      auto& f = s->fragments[i];
      DTRAIN_CHECK_ARG(!f.work, "checkpoint: DiLoCo loaded while fragment ", i, "'s average is in flight");
      f.arrived = arrived[static_cast<int64_t>(i)].item<int64_t>() != 0;
      f.delta = f.arrived ? pending[i].clone() : at::Tensor();
    }
    s->local_step = loaded;
  });
}

}  // namespace dtrain::checkpoint
