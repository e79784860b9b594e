#pragma once

// Where a module's parameters lie in the whole tensors they are parts of,
// for modules whose parameters are split over ranks (the tensor-parallel
// layers). checkpoint::add_module and add_optimizer read it: such a
// module's checkpoint holds the whole tensors, each rank writing its box,
// so it loads at another split or in one process. No torch here.

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

// Parameter `name` (as the module's named_parameters() says it) is the box
// [offsets[d], offsets[d] + size(d)) in each dimension d of a whole tensor
// of `shape`.
struct ParameterPlacement {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<int64_t> offsets;
};

// Implemented by modules that hold parts of whole parameters. Parameters it
// does not list are whole on every rank.
class ShardedParameters {
 public:
  virtual ~ShardedParameters() = default;
  virtual std::vector<ParameterPlacement> parameter_placements() const = 0;
};

}  // namespace dtrain
