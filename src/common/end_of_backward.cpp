#include "common/end_of_backward.h"

#include <torch/csrc/autograd/engine.h>

#include <memory>
#include <vector>

namespace dtrain::detail {
namespace {

using Callbacks = std::vector<std::function<void()>>;

// The callbacks deferred by each NestedBackward of this thread, innermost
// last. The engine runs a reentrant backward on the thread that started it.
thread_local std::vector<std::shared_ptr<Callbacks>> deferred;

}  // namespace

void queue_end_of_backward(std::function<void()> callback) {
  if (!deferred.empty()) {
    deferred.back()->push_back(std::move(callback));
    return;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

NestedBackward::NestedBackward() {
  auto mine = std::make_shared<Callbacks>();
  // Queued on the enclosing backward (or the NestedBackward around it): by
  // the time it runs, the inner backward has added whatever it deferred.
  queue_end_of_backward([mine] {
    for (size_t i = 0; i < mine->size(); ++i) (*mine)[i]();
  });
  deferred.push_back(std::move(mine));
}

NestedBackward::~NestedBackward() { deferred.pop_back(); }

}  // namespace dtrain::detail
