#pragma once

// The std::terminate handler that records an uncaught exception in the
// worker's error file (dtrain/launch_env.h: record_error).

namespace dtrain::detail {

// Once per process, and only when TORCHELASTIC_ERROR_FILE is set; the
// handler it replaces still runs after it.
void install_error_file_handler();

}  // namespace dtrain::detail
