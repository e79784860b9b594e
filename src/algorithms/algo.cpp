// DTRAIN_ALGO: which all_reduce algorithm a group runs (collectives.h).

#include "algorithms/collectives.h"
#include "common/enforce.h"
#include "common/env.h"

namespace dtrain::algorithms {

const char* to_string(AllReduceAlgo algo) {
  switch (algo) {
    case AllReduceAlgo::kRing: return "ring";
    case AllReduceAlgo::kRecursiveDoubling: return "recursive_doubling";
    case AllReduceAlgo::kTwoLevel: return "two_level";
    case AllReduceAlgo::kAuto: break;
  }
  return "auto";
}

AllReduceAlgo all_reduce_algo_from_env() {
  const std::string value = env::get(env::kAlgo).value_or("auto");
  for (auto algo : {AllReduceAlgo::kAuto, AllReduceAlgo::kRing,
                    AllReduceAlgo::kRecursiveDoubling, AllReduceAlgo::kTwoLevel})
    if (value == to_string(algo)) return algo;
  throw InvalidArgument(detail::cat("environment variable ", env::kAlgo.name, "='", value,
                                    "' is not valid (expected auto, ring, recursive_doubling or "
                                    "two_level)"));
}

}  // namespace dtrain::algorithms
