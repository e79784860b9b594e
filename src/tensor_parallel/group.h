#pragma once

// The tensor-parallel group a module or function works over: the one
// given, or the default group; this rank must be a member.

#include <memory>

#include "common/enforce.h"
#include "dtrain/distributed.h"
#include "dtrain/process_group.h"

namespace dtrain::tensor_parallel::detail {

inline std::shared_ptr<ProcessGroup> group_or_default(const std::shared_ptr<ProcessGroup>& given,
                                                      const char* what) {
  auto g = given ? given : default_group();
  DTRAIN_CHECK_ARG(g, what, ": no group given and no default group (init_process_group first)");
  DTRAIN_CHECK_ARG(g->rank() >= 0, what, ": this rank is not a member of group '", g->name(), "'");
  return g;
}

}  // namespace dtrain::tensor_parallel::detail
