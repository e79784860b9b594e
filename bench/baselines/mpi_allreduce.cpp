/* OpenMPI's MPI_Allreduce timed the way dtrain-bench collectives times
 * dtrain's all_reduce (bench/collectives.cpp, measure()): float32 SUM in
 * place, one checked call, two warm-up calls, a barrier, then as many calls
 * as move 1 GiB (5 to 20,000), each rank's mean time, the slowest rank's
 * counting. Prints one line per size in py_allreduce.py's format, which
 * dtrain-bench --baseline-mpi reads (the build's mpi-allreduce-baseline):
 *   bytes=    4096 time_us=   13.70 busbw_GBps=  0.598
 * Run under mpirun, e.g.
 *   mpirun -np 2 --mca btl tcp,self --mca pml ob1 mpi_allreduce   (TCP)
 *   mpirun -np 2 mpi_allreduce                                    (shared memory)
 * Sizes: the arguments (bytes), or 4 KiB to 64 MiB as py_allreduce.py. */
#include <mpi.h>
#include <cstdio>
#include <cstdlib>

static long iterations(long bytes) {
  long n = (1L << 30) / bytes;
  return n < 5 ? 5 : n > 20000 ? 20000 : n;
}

static void fill(float* x, long count, int seed) {
  for (long i = 0; i < count; ++i) x[i] = (float)((i + seed) % 3 + 1);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  static const long defaults[] = {4096, 65536, 1L << 20, 4L << 20, 16L << 20, 64L << 20};
  const int n_sizes = argc > 1 ? argc - 1 : (int)(sizeof(defaults) / sizeof(defaults[0]));
  int failed = 0;
  for (int s = 0; s < n_sizes; ++s) {
    const long bytes = argc > 1 ? atol(argv[s + 1]) : defaults[s];
    const long count = bytes / 4;
    float* x = static_cast<float*>(malloc(static_cast<size_t>(count) * sizeof(float)));
    if (count <= 0 || !x) {
      fprintf(stderr, "mpi_allreduce: bad size %ld\n", bytes);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    fill(x, count, rank);
    MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    long wrong = 0;
    for (long i = 0; i < count; ++i) {
      float expected = 0;
      for (int r = 0; r < world; ++r) expected += (float)((i + r) % 3 + 1);
      wrong += x[i] != expected;
    }
    failed |= wrong != 0;
    const long iters = iterations(bytes);
    for (int i = 0; i < 2; ++i)
      MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (long i = 0; i < iters; ++i)
      MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double seconds = (MPI_Wtime() - t0) / (double)iters, slowest;
    MPI_Allreduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
      printf("bytes=%10ld time_us=%10.2f busbw_GBps=%8.3f wrong=%ld\n", bytes, slowest * 1e6,
             bytes / slowest / 1e9 * 2.0 * (world - 1) / world, wrong);
    fflush(stdout);
    free(x);
  }
  MPI_Finalize();
  return failed ? 3 : 0;
}
