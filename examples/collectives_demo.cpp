// The communication core in action: every rank all-reduces and broadcasts a
// small tensor and prints what it sent and what it got back.
//   dtrain-run --nproc-per-node 4 ./collectives_demo     (or torchrun --no_python)

#include <dtrain/dtrain.h>

#include <ATen/ATen.h>

#include <iostream>
#include <sstream>

namespace {

// "[0, 1, 2, 3]" instead of ATen's multi-line tensor printout.
std::string values(const at::Tensor& t) {
  std::ostringstream out;
  auto d = t.to(at::kDouble).contiguous();
  out << "[";
  for (int64_t i = 0; i < d.numel(); ++i) out << (i ? ", " : "") << d.data_ptr<double>()[i];
  out << "]";
  return out.str();
}

}  // namespace

int main() {
  dtrain::init_process_group();  // env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  const int rank = dtrain::get_rank();
  const int world = dtrain::get_world_size();

  auto sent = at::arange(4, at::kFloat) + 10 * rank;
  auto summed = sent.clone();
  dtrain::all_reduce(summed);  // SUM over ranks, in place

  auto averaged = sent.clone();
  dtrain::all_reduce(averaged, dtrain::AllReduceOptions().op(dtrain::ReduceOp::AVG));

  auto message = at::full({3}, rank == 0 ? 42 : -1, at::kLong);
  dtrain::broadcast(message, /*src=*/0);

  // One line per rank, printed in rank order.
  for (int r = 0; r < world; ++r) {
    if (r == rank) {
      std::cout << "rank " << rank << "/" << world << ": sent " << values(sent)
                << " | all_reduce(SUM) -> " << values(summed) << " | all_reduce(AVG) -> "
                << values(averaged) << " | broadcast(src=0) -> " << values(message) << std::endl;
    }
    dtrain::barrier();
  }
  dtrain::destroy_process_group();
  return 0;
}
