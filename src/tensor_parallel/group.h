#pragma once

// The tensor-parallel group a module or function works over: the one
// given, or the default group; this rank must be a member.

#include <cstdint>
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

// Autograd functions keep their group as an integer in saved_data (an
// IValue holds no ProcessGroup): its address, valid while the caller's
// shared_ptr lives, which spans the forward and the backward of the graph.
inline int64_t group_address(ProcessGroup& g) { return reinterpret_cast<int64_t>(&g); }
inline ProcessGroup& group_at(int64_t address) { return *reinterpret_cast<ProcessGroup*>(address); }

}  // namespace dtrain::tensor_parallel::detail
