// The example from README.md, compiled so that it stays true.
#include <dtrain/dtrain.h>
#include <ATen/ATen.h>
#include <iostream>

int main() {
  dtrain::init_process_group();              // env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  int rank = dtrain::get_rank(), world = dtrain::get_world_size();

  auto grad = at::full({4}, float(rank));
  dtrain::all_reduce(grad, dtrain::AllReduceOptions().op(dtrain::ReduceOp::AVG));

  auto work = dtrain::broadcast(grad, /*src=*/0,
                                dtrain::CollectiveOptions().async_op(true));
  work->wait();                              // rethrows a failure, e.g. dtrain::TimeoutError

  auto pair = dtrain::new_group({0, 1});     // every rank calls it; ranks 0 and 1 are members
  if (rank < 2) dtrain::all_reduce(grad, dtrain::AllReduceOptions().group(pair));

  std::cout << "rank " << rank << "/" << world << ": " << grad[0].item<float>() << "\n";
  dtrain::destroy_process_group();
}
