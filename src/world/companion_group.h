#pragma once

// A group beside another: the same ranks in the same order, over the
// default group's store and addresses, for work that must not share the
// other group's sequence of collectives (an asynchronous checkpoint's
// background writer runs its collectives while training runs its own).

#include <memory>
#include <string>

#include "dtrain/process_group.h"

namespace dtrain::detail {

// Only `group`'s members call it, each the same number of times for the
// same `purpose`, in the same order. A tcp group (CPU tensors), named
// "<group>/<purpose>/<k>", with `group`'s timeout. Needs the default group
// (InvalidArgument naming `caller` otherwise).
std::shared_ptr<ProcessGroup> new_companion_group(const ProcessGroup& group, const std::string& purpose,
                                                  const std::string& caller);

}  // namespace dtrain::detail
