#pragma once

// Keeping replicas identical: the construction-time check that every rank
// wraps the same model, and coalesced broadcasts of parameters/buffers.

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "dtrain/process_group.h"

namespace dtrain::ddp {

// Throws InvalidArgument on every rank, naming the first parameter whose
// name, dtype or shape differs and what each rank has there (the message
// starts with `who`).
void verify_same_model(ProcessGroup& group, const std::vector<std::string>& names,
                       const std::vector<at::Tensor>& tensors,
                       const char* who = "DistributedDataParallel");

// Broadcasts `tensors` from group rank `src`, one flat tensor per dtype.
void broadcast_coalesced(ProcessGroup& group, const std::vector<at::Tensor>& tensors, int src);

}  // namespace dtrain::ddp
