#pragma once

// What a launcher (dtrain-run, torchrun, mpirun) tells a worker beyond its
// rank and world size, and what a worker tells it back. All of these work
// without a launcher too.

#include <exception>
#include <string>

namespace dtrain {

// TORCHELASTIC_RESTART_COUNT: 0 on the first attempt (or without a launcher),
// k after k restarts — the cue to resume from a checkpoint.
int restart_count();
// LOCAL_RANK: this process's rank on its machine (0 when unset).
int local_rank();
// True when what this process prints reaches a terminal: stdout is a TTY,
// or dtrain-run shows this worker's output on its own terminal (DTRAIN_TTY=1).
// Use it to choose between a live progress bar and plain log lines.
bool console_is_terminal();

// Error files (torchrun's TORCHELASTIC_ERROR_FILE, which dtrain-run and
// torchrun give every worker): writes why this worker is failing to that
// file, as torchrun's workers do (JSON, {"message": {"message": "<type>:
// <what>", "extraInfo": {"py_callstack": ..., "timestamp": "<unix s>"}}}),
// so that the launcher's failure summary shows the cause instead of only an
// exit code. Call it where you catch the exception that ends your program:
//   catch (const std::exception& e) { dtrain::record_error(e); return 1; }
// An exception nobody catches is recorded without this: init_process_group
// installs a std::terminate handler that records it, then calls the previous
// handler. Returns whether a file was written (false without the variable,
// or when it cannot be written); never throws.
bool record_error(const std::exception& e);
bool record_error(const std::string& message);

}  // namespace dtrain
