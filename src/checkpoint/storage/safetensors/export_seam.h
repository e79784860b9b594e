#pragma once

// Test seams of export_safetensors (not public), for rank 0's conversion.

#include <chrono>

namespace dtrain::checkpoint::detail {
// It stops with an Error before writing file number `files` (0-based),
// leaving on disk what a crash at that point leaves; -1: never (the default).
void stop_export_after_files(int files);
// It sleeps this long before each file (a slow disk); 0 by default.
void slow_export_files(std::chrono::milliseconds each);
}  // namespace dtrain::checkpoint::detail
