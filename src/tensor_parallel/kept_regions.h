#pragma once

// The region operations a RowParallelLinear ends with, for a selective
// checkpoint's recomputation (kept_outputs.h): the forward's output, kept,
// is handed back instead of running the collective again; the backward is
// the region's own.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "dtrain/process_group.h"

namespace dtrain::tensor_parallel::detail {

// reduce_from_region(x, group) that returns `kept`.
at::Tensor reduce_from_region_kept(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group,
                                   const at::Tensor& kept);

// reduce_scatter_to_sequence_region(x, group, dim) that returns `kept`
// (dim counted from the front).
at::Tensor reduce_scatter_to_sequence_region_kept(const at::Tensor& x,
                                                  const std::shared_ptr<ProcessGroup>& group,
                                                  int64_t dim, const at::Tensor& kept);

}  // namespace dtrain::tensor_parallel::detail
