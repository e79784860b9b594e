#pragma once

// A long step that only rank 0 runs (export_safetensors' conversion of
// the whole model), with the group's other ranks waiting for it. They wait
// for rank 0's word, not in a collective: rank 0 tells them it is alive
// every quarter of the group's timeout (at most every second), so the
// timeout bounds a stall (rank 0 gone or stuck), not the length of the
// step, which grows with the model and the disk.

#include <functional>
#include <string>

namespace dtrain {
class ProcessGroup;
}

namespace dtrain::checkpoint::detail {

// Collective over `group`. Rank 0 runs `step` and returns what it returned
// (an error text, "" for success); the others return "" once rank 0 is done,
// or throw NetworkError/TimeoutError, prefixed by `what`, when rank 0 went
// silent for the group's timeout or left. Callers then agree on the
// outcome (fail_together), every rank being present again.
std::string run_on_rank0(ProcessGroup& group, const std::string& what,
                         const std::function<std::string()>& step);

}  // namespace dtrain::checkpoint::detail
