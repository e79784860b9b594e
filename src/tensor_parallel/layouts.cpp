// Layouts (tensor_parallel.h, layouts.h) and enter_column_region.

#include "tensor_parallel/layouts.h"

#include <string>

#include "common/enforce.h"
#include "tensor_parallel/group.h"

namespace dtrain::tensor_parallel {

std::string Layout::str() const {
  return kind == Kind::kReplicate ? "Replicate()" : "Shard(" + std::to_string(dim) + ")";
}

namespace detail {

Layout checked_layout(const std::optional<Layout>& given, const Layout& fallback, Takes takes,
                      const char* module, const char* which) {
  const Layout l = given.value_or(fallback);
  if (l.kind == Layout::Kind::kReplicate) return l;
  const bool features = l.dim == -1;
  const bool sequence = takes == Takes::kReplicateOrSequence;
  DTRAIN_CHECK_ARG(features != sequence, module, ": ", which, " layout ", l.str(), ": it takes ",
                   sequence ? "Replicate() or Shard(d) with d the sequence (not the features, -1)"
                            : "Replicate() or Shard(-1) (the features)");
  return l;
}

int64_t sequence_dim_in(const Layout& layout, at::IntArrayRef sizes, const char* module, const char* which) {
  const auto dims = static_cast<int64_t>(sizes.size());
  const int64_t d = layout.dim < 0 ? layout.dim + dims : layout.dim;
  DTRAIN_CHECK_ARG(d >= 0 && d < dims - 1, module, ": ", which, " layout ", layout.str(),
                   " of a tensor of shape ", sizes, " (the last dimension is the features; ",
                   layout.str(), " must name the sequence)");
  return d;
}

int64_t sequence_dim_in(const Layout& layout, const at::Tensor& t, const char* module, const char* which) {
  return sequence_dim_in(layout, t.sizes(), module, which);
}

}  // namespace detail

ColumnInput enter_column_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group,
                                const Layout& layout) {
  const char* what = "enter_column_region";
  ColumnInput in;
  in.group_ = detail::group_or_default(group, what);
  const Layout l = detail::checked_layout(layout, layout, detail::Takes::kReplicateOrSequence, what, "input");
  if (l.kind == Layout::Kind::kReplicate) {
    in.whole_ = copy_to_region(x, in.group_);
    in.layout_ = l;
  } else {
    const int64_t d = detail::sequence_dim_in(l, x, what, "input");
    in.whole_ = gather_from_sequence_region(x, in.group_, d);
    in.layout_ = Shard(d);
  }
  return in;
}

}  // namespace dtrain::tensor_parallel
