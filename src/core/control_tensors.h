#pragma once

// Control tensors (ProcessGroup::control_device): small tensors built and
// read on the host, exchanged on the group's control device (the host for
// CPU backends, the group's GPU for nccl). Each call blocks until the result
// is back on the host.

#include <ATen/ATen.h>

#include <vector>

#include "dtrain/process_group.h"

namespace dtrain::detail {

inline at::Tensor all_reduce_control(ProcessGroup& group, const at::Tensor& host, ReduceOp op) {
  auto t = host.to(group.control_device());
  group.all_reduce(t, op)->wait();
  return t.cpu();
}

inline at::Tensor broadcast_control(ProcessGroup& group, const at::Tensor& host, int root) {
  auto t = host.to(group.control_device());
  group.broadcast(t, root)->wait();
  return t.cpu();
}

inline std::vector<at::Tensor> all_gather_control(ProcessGroup& group, const at::Tensor& host) {
  auto mine = host.to(group.control_device());
  std::vector<at::Tensor> rows;
  for (int r = 0; r < group.size(); ++r) rows.push_back(at::empty_like(mine));
  group.all_gather(rows, mine)->wait();
  for (auto& row : rows) row = row.cpu();
  return rows;
}

}  // namespace dtrain::detail
