#pragma once

// Checking and resolving the layouts of tensor_parallel.h: which layouts a
// layer takes (at construction) and which dimension a Shard splits in the
// tensor the layer meets (at forward).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "dtrain/tensor_parallel.h"

namespace dtrain::tensor_parallel::detail {

// Which layouts a layer's input or output takes.
enum class Takes {
  kReplicateOrSequence,  // a column layer's input; a row layer's or an embedding's output
  kReplicateOrFeatures,  // a column layer's output; a row layer's input
};

// `given`, or `fallback` when unset, checked against what it takes
// (InvalidArgument naming `module`, `which` ("input", "output") and the
// layout otherwise).
Layout checked_layout(const std::optional<Layout>& given, const Layout& fallback, Takes takes,
                      const char* module, const char* which);

// The sequence dimension a Shard layout splits in `t` (its dim resolved),
// checked to be neither outside `t` nor its last (the features).
int64_t sequence_dim_in(const Layout& layout, const at::Tensor& t, const char* module,
                        const char* which);
int64_t sequence_dim_in(const Layout& layout, at::IntArrayRef sizes, const char* module,
                        const char* which);

}  // namespace dtrain::tensor_parallel::detail
