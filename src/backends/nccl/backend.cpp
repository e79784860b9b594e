#include "backends/nccl/backend.h"

#include <ATen/ATen.h>

#include <chrono>

#include "backends/nccl/communicator.h"
#include "backends/nccl/cuda_api.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "core/backend_registry.h"
#include "core/failure_state.h"
#include "dtrain/distributed.h"

namespace dtrain::nccl_backend {

using Clock = std::chrono::steady_clock;

// One operation queued on the group's stream, held until its end event.
struct InFlight {
  WorkPtr work;
  std::shared_ptr<Event> end;
  std::vector<at::Tensor> tensors;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout;
};

namespace {

ncclDataType_t nccl_type(const std::string& what, at::ScalarType t, bool reduces) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    case at::kBool:
      if (!reduces) return ncclUint8;
      break;
    default:
      break;
  }
  throw InvalidArgument(detail::cat(what, ": nccl cannot ", reduces ? "reduce" : "move",
                                    " tensors of dtype ", c10::toString(t),
                                    " (supported: float, double, half, bfloat16, int8, uint8, "
                                    "int32, int64", reduces ? "" : ", bool", ")"));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return ncclSum;
    case ReduceOp::AVG: return ncclAvg;  // floating types only (averages())
    case ReduceOp::PRODUCT: return ncclProd;
    case ReduceOp::MIN: return ncclMin;
    case ReduceOp::MAX: return ncclMax;
    case ReduceOp::BAND:
    case ReduceOp::BOR:
    case ReduceOp::BXOR:
      throw InvalidArgument(detail::cat("nccl: ReduceOp::", to_string(op),
                                        " is not supported (NCCL has no bitwise reductions)"));
    case ReduceOp::PREMUL_SUM:
      break;  // the free functions turn it into SUM; TensorChecks refuses it here
  }
  throw InternalError("nccl: unknown ReduceOp");
}

size_t count(const at::Tensor& t) { return static_cast<size_t>(t.numel()); }

// The group's device: the one named (InitOptions::device_id), else
// LOCAL_RANK modulo the GPUs (one GPU per local rank, as torchrun jobs run),
// else the creating thread's current device.
int choose_device(int named, int devices) {
  if (named >= 0) {
    DTRAIN_CHECK_ARG(named < devices, "nccl: device_id ", named, " is out of range: this process sees ",
                     devices, " CUDA device(s)");
    return named;
  }
  if (auto local = env::get_int(env::kLocalRank, 0, 1 << 20)) return static_cast<int>(*local % devices);
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

}  // namespace

NcclBackend::NcclBackend(std::shared_ptr<Store> store, int rank, int size,
                                   GroupOptions options)
    : Backend(rank, size, std::move(options)) {
  const int devices = usable_device_count();  // no GPU: BackendUnavailable naming CUDA's error
  if (!have_torch_cuda())
    throw BackendUnavailable(
        "nccl: this dtrain was built against a libtorch without CUDA (no c10_cuda), which "
        "cannot hold CUDA tensors; build dtrain against a CUDA-enabled libtorch "
        "(docs/compatibility.md)");
  device_ = choose_device(this->options().device_id(), devices);
  const std::string what =
      detail::cat("nccl: group '", name(), "' (rank ", rank, "/", size, ", cuda:", device_, ")");
  comm_ = std::make_unique<Communicator>(*store, "nccl/unique_id", rank, size, device_, timeout(),
                                         what);
  stream_ = std::make_unique<Stream>(device_);
  watchdog_ = std::thread([this] { watch(); });
  DTRAIN_LOG_INFO(what, ": communicator ready");
}

NcclBackend::~NcclBackend() {
  {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    stop_ = true;
  }
  watch_cv_.notify_all();
  // The watchdog returns once nothing is in flight: each operation finishes
  // or is aborted at its deadline.
  if (watchdog_.joinable()) watchdog_.join();
}

bool NcclBackend::averages(c10::ScalarType dtype) const { return at::isFloatingType(dtype); }

void NcclBackend::abort(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(issue_mutex_);
  if (!failures_.error()) break_group(std::move(error));
}

c10::Device NcclBackend::control_device() const {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_));
}

void NcclBackend::check_device(const Call& call, const at::Tensor& t) const {
  DTRAIN_CHECK_ARG(t.device().index() == device_, call.description, ": a tensor is on ",
                   t.device(), " but the group uses cuda:", device_,
                   " (the current CUDA device when it was created)");
}

std::vector<at::Tensor> NcclBackend::checked(const Call& call, std::vector<at::Tensor> list,
                                                  const at::Tensor& one) const {
  list.push_back(one);
  for (const auto& t : list) check_device(call, t);
  return list;
}

void NcclBackend::settle(const Call& call, int status, const char* what) {
  comm_->settle(static_cast<ncclResult_t>(status), what, Clock::now() + call.timeout,
                call.description);
}

void NcclBackend::grouped(const Call& call, const std::function<void()>& body) {
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  body();
  settle(call, ncclGroupEnd(), "ncclGroupEnd");
}

WorkPtr NcclBackend::launch(const Call& call, std::vector<at::Tensor> tensors,
                                 const std::function<void()>& body, Launch how) {
  auto work = std::make_shared<Work>(call.description);
  if (how.source_rank >= 0) work->set_source_rank(how.source_rank);
  // Under the issue lock the watchdog cannot abort the communicator while
  // this operation is being queued on it (it takes the same lock first).
  std::lock_guard<std::mutex> issue(issue_mutex_);
  if (failures_.refuse(*work)) return work;
  DeviceScope on_device(device_);
  auto item = std::make_shared<InFlight>();
  item->tensors = std::move(tensors);
  try {
    Event ready(device_);
    ready.record(current_stream(device_));
    ready.block(stream_->get());
    {
      StreamScope on_stream(stream_->get(), device_);
      body();
    }
    item->end = std::make_shared<Event>(device_);
    item->end->record(stream_->get());
  } catch (const InvalidArgument&) {
    throw;  // refused before anything was queued (every rank refuses alike)
  } catch (...) {
    // NCCL or CUDA failed while queuing: the communicator is in an unknown
    // state on this rank, so it breaks like a timeout. The tensors stay held
    // until the stream has drained (break_group).
    const auto error = std::current_exception();
    break_group(error);
    work->finish(error);
    return work;
  }
  if (!how.host_blocking) {
    work->set_device_wait([end = item->end, device = device_] {
      DeviceScope scope(device);
      end->block(current_stream(device));
    });
  }
  item->work = work;
  item->timeout = call.timeout;
  item->deadline = Clock::now() + call.timeout;
  {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    in_flight_.push_back(std::move(item));
  }
  watch_cv_.notify_all();
  return work;
}

// The caller holds issue_mutex_. The group is marked broken first (launch
// refuses new work from then on), the communicator aborted (NCCL's kernels
// return), the stream drained, and only then are the operations in flight
// failed and their tensors released: nothing queued may still touch them.
void NcclBackend::break_group(std::exception_ptr error) {
  failures_.break_with(error);
  comm_->abort();
  cudaStreamSynchronize(stream_->get());  // errors here change nothing: the group is broken
  cudaGetLastError();
  std::deque<std::shared_ptr<InFlight>> failed;
  {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    failed.swap(in_flight_);
  }
  for (auto& f : failed) f->work->finish(error);
}

// The watchdog. Operations run on one stream, so they finish in issue
// order: only the oldest needs watching. NCCL's asynchronous errors are
// polled alongside. An entry is shared, so a break_group on another thread
// cannot free it under the watchdog; it is popped only if still the oldest.
void NcclBackend::watch() {
  std::unique_lock<std::mutex> lock(watch_mutex_);
  for (;;) {
    if (in_flight_.empty()) {
      if (stop_) return;
      watch_cv_.wait_for(lock, std::chrono::milliseconds(100));
      continue;
    }
    const std::shared_ptr<InFlight> oldest = in_flight_.front();
    lock.unlock();
    std::exception_ptr error;
    bool done = false;
    try {
      done = oldest->end->done();
      const ncclResult_t async = comm_->async_error();
      if (!done && async != ncclSuccess && async != ncclInProgress)
        check_nccl(async, "ncclCommGetAsyncError", comm_->get());
      if (!done && Clock::now() >= oldest->deadline) {
        throw TimeoutError(detail::cat(
            oldest->work->description(), " did not finish on the GPU within ",
            oldest->timeout.count(),
            " ms (a stopped, slow or dead peer?); the NCCL communicator was aborted"));
      }
    } catch (...) {
      error = std::current_exception();
    }
    if (error) {
      std::lock_guard<std::mutex> issue(issue_mutex_);
      break_group(error);
      lock.lock();
      continue;
    }
    lock.lock();
    if (done && !in_flight_.empty() && in_flight_.front() == oldest) {
      in_flight_.pop_front();
      // After an abort an end event completes too: that is not a success.
      const auto broken = failures_.error();
      lock.unlock();
      oldest->work->finish(broken ? broken_group_error(oldest->work->description(), broken)
                                  : nullptr);
      lock.lock();
      continue;
    }
    if (!done) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      lock.lock();
    }
  }
}

// ---- collectives ------------------------------------------------------------

WorkPtr NcclBackend::do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) {
  check_device(call, tensor);
  const auto type = nccl_type(call.op, tensor.scalar_type(), true);
  return launch(call, {tensor}, [&] {
    settle(call,
           ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), count(tensor), type,
                         nccl_op(op), comm_->get(), stream_->get()),
           "ncclAllReduce");
  });
}

WorkPtr NcclBackend::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  check_device(call, tensor);
  const auto type = nccl_type(call.op, tensor.scalar_type(), false);
  return launch(call, {tensor}, [&] {
    settle(call,
           ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), count(tensor), type, root,
                         comm_->get(), stream_->get()),
           "ncclBroadcast");
  });
}

WorkPtr NcclBackend::do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) {
  check_device(call, tensor);
  const auto type = nccl_type(call.op, tensor.scalar_type(), true);
  return launch(call, {tensor}, [&] {
    settle(call,
           ncclReduce(tensor.data_ptr(), tensor.data_ptr(), count(tensor), type,
                      nccl_op(op), root, comm_->get(), stream_->get()),
           "ncclReduce");
  });
}

WorkPtr NcclBackend::do_all_gather_into_tensor(const Call& call, at::Tensor output,
                                                    at::Tensor input) {
  check_device(call, output), check_device(call, input);
  const auto type = nccl_type(call.op, input.scalar_type(), false);
  return launch(call, {output, input}, [&] {
    settle(call,
           ncclAllGather(input.data_ptr(), output.data_ptr(), count(input), type, comm_->get(),
                         stream_->get()),
           "ncclAllGather");
  });
}

WorkPtr NcclBackend::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                        at::Tensor input) {
  auto keep = checked(call, outputs, input);
  const auto type = nccl_type(call.op, input.scalar_type(), false);
  return launch(call, std::move(keep), [&] {
    // Allocated on the group's stream (StreamScope), reused only behind it.
    auto flat = at::empty({size() * input.numel()}, input.options());
    settle(call,
           ncclAllGather(input.data_ptr(), flat.data_ptr(), count(input), type, comm_->get(),
                         stream_->get()),
           "ncclAllGather");
    for (int r = 0; r < size(); ++r)
      outputs[r].view({-1}).copy_(flat.narrow(0, r * input.numel(), input.numel()));
  });
}

WorkPtr NcclBackend::do_reduce_scatter_tensor(const Call& call, at::Tensor output,
                                                   at::Tensor input, ReduceOp op) {
  check_device(call, output), check_device(call, input);
  const auto type = nccl_type(call.op, input.scalar_type(), true);
  return launch(call, {output, input}, [&] {
    settle(call,
           ncclReduceScatter(input.data_ptr(), output.data_ptr(), count(output), type,
                             nccl_op(op), comm_->get(), stream_->get()),
           "ncclReduceScatter");
  });
}

WorkPtr NcclBackend::do_reduce_scatter(const Call& call, at::Tensor output,
                                            std::vector<at::Tensor> inputs, ReduceOp op) {
  auto keep = checked(call, inputs, output);
  const auto type = nccl_type(call.op, output.scalar_type(), true);
  return launch(call, std::move(keep), [&] {
    std::vector<at::Tensor> flat_inputs;
    for (const auto& t : inputs) flat_inputs.push_back(t.reshape({-1}));
    auto flat = at::cat(flat_inputs);
    settle(call,
           ncclReduceScatter(flat.data_ptr(), output.data_ptr(), count(output), type,
                             nccl_op(op), comm_->get(), stream_->get()),
           "ncclReduceScatter");
  });
}

// gather, scatter and all_to_all: NCCL's grouped send/recv (inside
// ncclGroupStart/End, where the calls only queue); the rank's own piece is a
// device copy. Empty pieces are not sent: both sides know their size.
void NcclBackend::send_to(const at::Tensor& t, int peer, int type) {
  if (count(t) == 0) return;
  check_nccl(ncclSend(t.data_ptr(), count(t), static_cast<ncclDataType_t>(type), peer,
                      comm_->get(), stream_->get()),
             "ncclSend");
}

void NcclBackend::recv_from(const at::Tensor& t, int peer, int type) {
  if (count(t) == 0) return;
  check_nccl(ncclRecv(t.data_ptr(), count(t), static_cast<ncclDataType_t>(type), peer,
                      comm_->get(), stream_->get()),
             "ncclRecv");
}

WorkPtr NcclBackend::rooted(const Call& call, std::vector<at::Tensor> blocks, at::Tensor own,
                            int root, bool to_root) {
  auto keep = checked(call, blocks, own);
  const auto type = nccl_type(call.op, own.scalar_type(), false);
  return launch(call, std::move(keep), [&] {
    grouped(call, [&] {
      if (rank() != root) return to_root ? send_to(own, root, type) : recv_from(own, root, type);
      for (int r = 0; r < size(); ++r)
        if (r != root) to_root ? recv_from(blocks[r], r, type) : send_to(blocks[r], r, type);
    });
    if (rank() == root) (to_root ? blocks[root] : own).copy_(to_root ? own : blocks[root]);
  });
}

WorkPtr NcclBackend::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                               at::Tensor input, int root) {
  return rooted(call, std::move(outputs), std::move(input), root, true);
}

WorkPtr NcclBackend::do_scatter(const Call& call, at::Tensor output,
                                std::vector<at::Tensor> inputs, int root) {
  return rooted(call, std::move(inputs), std::move(output), root, false);
}

WorkPtr NcclBackend::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                        std::vector<at::Tensor> inputs) {
  for (const auto& t : outputs) check_device(call, t);
  for (const auto& t : inputs) check_device(call, t);
  const auto type = nccl_type(call.op, inputs.at(0).scalar_type(), false);
  auto keep = outputs;
  keep.insert(keep.end(), inputs.begin(), inputs.end());
  return launch(call, std::move(keep), [&] {
    grouped(call, [&] {
      for (int r = 0; r < size(); ++r) {
        if (r == rank()) continue;
        send_to(inputs[r], r, type);
        recv_from(outputs[r], r, type);
      }
    });
    outputs[rank()].copy_(inputs[rank()]);
  });
}

// Blocks the host (as PyTorch's barrier on NCCL does): a one-element
// all_reduce whose Work is waited on by the host.
WorkPtr NcclBackend::do_barrier(const Call& call) {
  auto one = at::zeros({1}, at::TensorOptions(at::kFloat).device(control_device()));
  return launch(
      call, {one},
      [&] {
        settle(call,
               ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum,
                             comm_->get(), stream_->get()),
               "ncclAllReduce");
      },
      Launch{/*host_blocking=*/true});
}

WorkPtr NcclBackend::do_monitored_barrier(const Call& call, bool) {
  throw InvalidArgument(detail::cat(call.description,
                                    ": monitored_barrier is not available on nccl (nor in "
                                    "PyTorch); run it on a CPU group, e.g. "
                                    "dtrain::new_group(ranks, \"tcp\")"));
}

WorkPtr NcclBackend::do_send(const Call& call, at::Tensor tensor, int dst, int) {
  check_device(call, tensor);
  const auto type = nccl_type(call.op, tensor.scalar_type(), false);
  return launch(call, {tensor}, [&] {
    settle(call, ncclSend(tensor.data_ptr(), count(tensor), type, dst, comm_->get(), stream_->get()),
           "ncclSend");
  });
}

WorkPtr NcclBackend::do_recv(const Call& call, at::Tensor tensor, int src, int) {
  check_device(call, tensor);
  DTRAIN_CHECK_ARG(src != kAnySource, call.description,
                   ": recv from any source is not available on nccl (NCCL matches each receive "
                   "with a named peer); name the source rank, or use a tcp group");
  const auto type = nccl_type(call.op, tensor.scalar_type(), false);
  return launch(call, {tensor}, [&] {
    settle(call, ncclRecv(tensor.data_ptr(), count(tensor), type, src, comm_->get(), stream_->get()),
           "ncclRecv");
  }, Launch{false, src});
}

std::vector<WorkPtr> NcclBackend::post_batch(const std::vector<Call>& calls,
                                                  std::vector<Op> ops) {
  Call call = calls.front();
  call.description = detail::cat("batch_isend_irecv of ", ops.size(), " (", calls.front().op,
                                 " #", calls.front().seq, " to ", calls.back().op, " #",
                                 calls.back().seq, ") on group '", name(), "' (rank ", rank(),
                                 "/", size(), ", backend nccl)");
  std::vector<at::Tensor> tensors;
  for (const auto& op : ops) {
    const bool send = op.type == OpType::SEND;
    tensors.push_back(send ? op.inputs[0] : op.outputs[0]);
    check_device(call, tensors.back());
    DTRAIN_CHECK_ARG(send || op.root != kAnySource, call.description,
                     ": recv from any source is not available on nccl; name the source rank");
  }
  auto work = launch(call, tensors, [&] {
    grouped(call, [&] {
      for (size_t i = 0; i < ops.size(); ++i) {
        const int type = nccl_type(calls[i].op, tensors[i].scalar_type(), false);
        if (ops[i].type == OpType::SEND) send_to(tensors[i], ops[i].root, type);
        else recv_from(tensors[i], ops[i].root, type);
      }
    });
  });
  return std::vector<WorkPtr>(ops.size(), work);
}

DTRAIN_REGISTER_BACKEND(nccl, register_backend("nccl", {c10::DeviceType::CUDA},
                                                [](std::shared_ptr<Store> store, int rank,
                                                   int size, const GroupOptions& options) {
                                                  return std::make_shared<NcclBackend>(
                                                      std::move(store), rank, size, options);
                                                }))

}  // namespace dtrain::nccl_backend
