#pragma once

// What a launcher (dtrain-run, torchrun, mpirun) tells a worker beyond its
// rank and world size. All of these work without a launcher too.

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

}  // namespace dtrain
