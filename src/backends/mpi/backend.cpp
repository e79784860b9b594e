#include "backends/mpi/backend.h"

#include <ATen/ATen.h>

#include <chrono>
#include <climits>
#include <numeric>
#include <thread>

#include "backends/mpi/runtime.h"
#include "core/broken_group.h"
#include "common/enforce.h"
#include "core/average.h"
#include "common/logging.h"

namespace dtrain::mpi_backend {

struct MpiProcessGroup::Comm {
  MPI_Comm comm = MPI_COMM_NULL;
};

struct MpiProcessGroup::Posted {
  MPI_Request request = MPI_REQUEST_NULL;
};

namespace {

using Clock = std::chrono::steady_clock;

std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, len);
}

void check(int code, const std::string& what) {
  if (code != MPI_SUCCESS) throw NetworkError(what + " failed: MPI error: " + error_text(code));
}

int count_of(const at::Tensor& t, const std::string& what) {
  DTRAIN_CHECK_ARG(t.numel() <= INT_MAX, what, ": MPI counts are int; ", t.numel(),
                   " elements is too many (split the tensor)");
  return static_cast<int>(t.numel());
}


at::Tensor concat(const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  for (const auto& p : parts) flat.push_back(p.reshape({-1}));
  return at::cat(flat);
}

void split_into(const at::Tensor& flat, const std::vector<at::Tensor>& outputs) {
  int64_t offset = 0;
  for (const auto& out : outputs) {
    out.view({-1}).copy_(flat.narrow(0, offset, out.numel()));
    offset += out.numel();
  }
}

}  // namespace

std::pair<int, int> mpi_world() { return world_rank_and_size(); }

MpiProcessGroup::MpiProcessGroup(int rank, int size, GroupOptions options)
    : ProcessGroup(rank, size, std::move(options)), comm_(std::make_unique<Comm>()) {
  ensure_initialized();
  const auto what = detail::cat("mpi: creating group '", name(), "' (rank ", rank, "/", size, ")");
  const auto [world_rank, world_size] = world_rank_and_size();
  const auto& members = this->options().global_ranks();
  if (members.empty()) {
    if (world_size != size || world_rank != rank)
      throw InvalidArgument(detail::cat(
          what, ": MPI_COMM_WORLD has this process as rank ", world_rank, " of ", world_size,
          "; with backend mpi, rank and world size come from mpirun (leave RANK and "
          "WORLD_SIZE unset or equal to MPI's)"));
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_->comm), what);
  } else {
    MPI_Group world_group, sub_group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, static_cast<int>(members.size()), members.data(), &sub_group);
    check(MPI_Comm_create_group(MPI_COMM_WORLD, sub_group, /*tag=*/0, &comm_->comm), what);
    MPI_Group_free(&sub_group);
    MPI_Group_free(&world_group);
  }
  MPI_Comm_set_errhandler(comm_->comm, MPI_ERRORS_RETURN);
  int comm_rank = -1;
  MPI_Comm_rank(comm_->comm, &comm_rank);
  DTRAIN_ENFORCE_EQ(comm_rank, rank);
  DTRAIN_LOG_INFO("mpi: group '", name(), "' ready, rank ", rank, "/", size);
}

MpiProcessGroup::~MpiProcessGroup() {
  // The executors (declared last) have drained by the time members go; free
  // the communicator unless MPI is already finalized (process exit).
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_->comm != MPI_COMM_NULL) MPI_Comm_free(&comm_->comm);
}

WorkPtr MpiProcessGroup::launch(const Call& call, SerialExecutor& executor,
                                const std::function<void(Posted&)>& post,
                                std::function<void()> after) {
  auto work = std::make_shared<Work>(call.description);
  {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    if (broken_) {
      work->finish(broken_group_error(call.description, broken_));
      return work;
    }
  }
  auto posted = std::make_shared<Posted>();
  post(*posted);  // on the caller's thread, in issue order
  executor.submit([this, work, posted, after = std::move(after), call] {
    std::exception_ptr error;
    try {
      const auto deadline = Clock::now() + call.timeout;
      for (int polls = 0;; ++polls) {
        int done = 0;
        MPI_Status status;
        check(MPI_Test(&posted->request, &done, &status), call.description);
        if (done) break;
        if (Clock::now() >= deadline)
          throw TimeoutError(detail::cat(call.description, " timed out after ",
                                         call.timeout.count(),
                                         " ms (MPI cannot cancel it: the group is broken)"));
        // Poll hot at first, then back off so a waiting rank leaves the CPU.
        if (polls > 200) std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if (after) after();
    } catch (...) {
      error = std::current_exception();
      std::lock_guard<std::mutex> lock(broken_mutex_);
      broken_ = error;
    }
    work->finish(error);
  });
  return work;
}

WorkPtr MpiProcessGroup::do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) {
  const int n = count_of(tensor, call.description);
  return launch(
      call, collectives_,
      [&](Posted& p) {
        check(MPI_Iallreduce(MPI_IN_PLACE, tensor.data_ptr(), n, datatype(tensor.scalar_type()),
                             reduction(tensor.scalar_type(), op), comm_->comm, &p.request),
              call.description);
      },
      [tensor, op, size = size()] {
        if (op == ReduceOp::AVG) divide_for_average(tensor, size);
      });
}

WorkPtr MpiProcessGroup::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  const int n = count_of(tensor, call.description);
  return launch(call, collectives_, [&](Posted& p) {
    check(MPI_Ibcast(tensor.data_ptr(), n, datatype(tensor.scalar_type()), root, comm_->comm,
                     &p.request),
          call.description);
  }, [tensor] {});
}

WorkPtr MpiProcessGroup::do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) {
  const int n = count_of(tensor, call.description);
  const bool is_root = rank() == root;
  // Non-roots reduce from a copy so that their tensor stays unchanged.
  auto send = is_root ? tensor : tensor.clone();
  return launch(
      call, collectives_,
      [&](Posted& p) {
        check(MPI_Ireduce(is_root ? MPI_IN_PLACE : send.data_ptr(),
                          is_root ? tensor.data_ptr() : nullptr, n,
                          datatype(tensor.scalar_type()), reduction(tensor.scalar_type(), op),
                          root, comm_->comm, &p.request),
              call.description);
      },
      [tensor, send, op, is_root, size = size()] {
        if (is_root && op == ReduceOp::AVG) divide_for_average(tensor, size);
      });
}

WorkPtr MpiProcessGroup::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                       at::Tensor input) {
  const int n = count_of(input, call.description);
  auto flat = at::empty({int64_t(size()) * n}, input.options());
  return launch(
      call, collectives_,
      [&](Posted& p) {
        const auto type = datatype(input.scalar_type());
        check(MPI_Iallgather(input.data_ptr(), n, type, flat.data_ptr(), n, type, comm_->comm,
                             &p.request),
              call.description);
      },
      [flat, outputs, input] { split_into(flat, outputs); });
}

WorkPtr MpiProcessGroup::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                                   at::Tensor input, int root) {
  const int n = count_of(input, call.description);
  const bool is_root = rank() == root;
  auto flat = is_root ? at::empty({int64_t(size()) * n}, input.options()) : at::Tensor();
  return launch(
      call, collectives_,
      [&](Posted& p) {
        const auto type = datatype(input.scalar_type());
        check(MPI_Igather(input.data_ptr(), n, type, is_root ? flat.data_ptr() : nullptr, n, type,
                          root, comm_->comm, &p.request),
              call.description);
      },
      [flat, outputs, input, is_root] {
        if (is_root) split_into(flat, outputs);
      });
}

WorkPtr MpiProcessGroup::do_scatter(const Call& call, at::Tensor output,
                                    std::vector<at::Tensor> inputs, int root) {
  const int n = count_of(output, call.description);
  const bool is_root = rank() == root;
  auto flat = is_root ? concat(inputs) : at::Tensor();
  return launch(call, collectives_, [&](Posted& p) {
    const auto type = datatype(output.scalar_type());
    check(MPI_Iscatter(is_root ? flat.data_ptr() : nullptr, n, type, output.data_ptr(), n, type,
                       root, comm_->comm, &p.request),
          call.description);
  }, [flat, output] {});
}

WorkPtr MpiProcessGroup::do_reduce_scatter(const Call& call, at::Tensor output,
                                           std::vector<at::Tensor> inputs, ReduceOp op) {
  const int n = count_of(output, call.description);
  auto flat = concat(inputs);
  return launch(
      call, collectives_,
      [&](Posted& p) {
        check(MPI_Ireduce_scatter_block(flat.data_ptr(), output.data_ptr(), n,
                                        datatype(output.scalar_type()),
                                        reduction(output.scalar_type(), op), comm_->comm,
                                        &p.request),
              call.description);
      },
      [flat, output, op, size = size()] {
        if (op == ReduceOp::AVG) divide_for_average(output, size);
      });
}

WorkPtr MpiProcessGroup::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                       std::vector<at::Tensor> inputs) {
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
  int offset = 0;
  for (const auto& in : inputs) {
    send_counts.push_back(count_of(in, call.description));
    send_displs.push_back(offset);
    offset += send_counts.back();
  }
  offset = 0;
  for (const auto& out : outputs) {
    recv_counts.push_back(count_of(out, call.description));
    recv_displs.push_back(offset);
    offset += recv_counts.back();
  }
  auto flat_in = concat(inputs);
  auto flat_out = at::empty({offset}, flat_in.options());
  auto counts = std::make_shared<std::vector<std::vector<int>>>(
      std::vector<std::vector<int>>{send_counts, send_displs, recv_counts, recv_displs});
  return launch(
      call, collectives_,
      [&](Posted& p) {
        const auto type = datatype(flat_in.scalar_type());
        // The count arrays must outlive the request: `counts` is kept below.
        check(MPI_Ialltoallv(flat_in.data_ptr(), (*counts)[0].data(), (*counts)[1].data(), type,
                             flat_out.data_ptr(), (*counts)[2].data(), (*counts)[3].data(), type,
                             comm_->comm, &p.request),
              call.description);
      },
      [flat_in, flat_out, outputs, counts] { split_into(flat_out, outputs); });
}

WorkPtr MpiProcessGroup::do_barrier(const Call& call) {
  return launch(call, collectives_, [&](Posted& p) {
    check(MPI_Ibarrier(comm_->comm, &p.request), call.description);
  });
}

WorkPtr MpiProcessGroup::do_send(const Call& call, at::Tensor tensor, int dst, int tag) {
  const int n = count_of(tensor, call.description);
  return launch(call, p2p_waits_, [&](Posted& p) {
    check(MPI_Isend(tensor.data_ptr(), n, datatype(tensor.scalar_type()), dst, tag, comm_->comm,
                    &p.request),
          call.description);
  }, [tensor] {});
}

WorkPtr MpiProcessGroup::do_recv(const Call& call, at::Tensor tensor, int src, int tag) {
  const int n = count_of(tensor, call.description);
  return launch(call, p2p_waits_, [&](Posted& p) {
    check(MPI_Irecv(tensor.data_ptr(), n, datatype(tensor.scalar_type()), src, tag, comm_->comm,
                    &p.request),
          call.description);
  }, [tensor] {});
}

}  // namespace dtrain::mpi_backend
