#pragma once

// Callbacks at the end of a backward pass, for DDP's reduction and the
// like, that hold when activation checkpointing runs a backward inside the
// backward (activation_checkpoint.h): libtorch's Engine::queue_callback
// attaches a callback to the backward that is running, and inside a
// checkpoint's recomputation that is the inner one, which ends before the
// enclosing backward has reached the rest of the model.

#include <functional>

namespace dtrain::detail {

// Runs `callback` when the backward now running on this thread has finished;
// inside a NestedBackward, when the enclosing one has.
void queue_end_of_backward(std::function<void()> callback);

// Held around a backward started inside a backward: callbacks queued meanwhile
// (on this thread) run at the end of the enclosing backward instead.
class NestedBackward {
 public:
  NestedBackward();
  ~NestedBackward();
  NestedBackward(const NestedBackward&) = delete;
  NestedBackward& operator=(const NestedBackward&) = delete;
};

}  // namespace dtrain::detail
