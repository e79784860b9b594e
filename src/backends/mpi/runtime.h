#pragma once

// The MPI library as dtrain uses it: initialized once per process with
// MPI_THREAD_MULTIPLE (groups post from callers' threads and complete on
// their own), finalized at exit, plus the datatypes and reduction ops for
// every dtype and ReduceOp of the communication core. Only this file and
// backend.cpp include <mpi.h>.

#include <c10/core/ScalarType.h>
#include <mpi.h>

#include <utility>

#include "dtrain/process_group.h"

namespace dtrain::mpi_backend {

// Initializes MPI if nobody has (and arranges MPI_Finalize at exit); throws
// BackendUnavailable when the library lacks MPI_THREAD_MULTIPLE.
void ensure_initialized();
// {rank, size} in MPI_COMM_WORLD.
std::pair<int, int> world_rank_and_size();

MPI_Datatype datatype(c10::ScalarType dtype);
// AVG is not an MPI op: the group sums and divides (MpiBackend does not
// average). float16/bfloat16 use ops of
// our own (combined in float32, rounded once).
MPI_Op reduction(c10::ScalarType dtype, ReduceOp op);

}  // namespace dtrain::mpi_backend
