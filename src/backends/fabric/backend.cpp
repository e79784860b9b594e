#include "backends/fabric/backend.h"

#include <ATen/ATen.h>

#include <cstring>
#include <thread>

#include "algorithms/collectives.h"
#include "algorithms/reduce_kernels.h"
#include "algorithms/slots.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "core/failure_state.h"
#include "dtrain/distributed.h"
#include "store/auth.h"

namespace dtrain::fabric_backend {
namespace {

// The reductions the kernels implement; anything else is refused before a
// byte is sent, so that no rank is left waiting.
void check_reducible(const std::string& what, const at::Tensor& t) {
  if (kernels::can_reduce(t.scalar_type())) return;
  throw InvalidArgument(detail::cat(what, ": cannot reduce tensors of dtype ",
                                    c10::toString(t.scalar_type()),
                                    " (supported: float, double, half, bfloat16, int8, uint8, "
                                    "int32, int64)"));
}

// The engine's errors raised by every rank at the same step: a mismatch
// that the shared slots found (every rank compares the same descriptors).
// Anything else, a mismatch found by a transport included, breaks the group.
bool raised_in_step(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const algorithms::slots::Mismatch&) {
    return true;
  } catch (const algorithms::slots::SizeMismatch&) {
    return true;
  } catch (...) {
    return false;
  }
}

// DTRAIN_TCP_STREAMS; "auto": a second stream (and I/O thread) pays off only
// where cores are left for it (measured: on 2 cores one stream is faster).
int streams_from_env() {
  if (env::get(env::kTcpStreams).value_or("auto") == "auto")
    return std::thread::hardware_concurrency() > 4 ? 2 : 1;
  return static_cast<int>(*env::get_int(env::kTcpStreams, 1, 16));
}

size_t count_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()); }

std::vector<void*> pointers(const std::vector<at::Tensor>& ts) {
  std::vector<void*> out;
  for (const auto& t : ts) out.push_back(t.data_ptr());
  return out;
}
std::vector<const void*> const_pointers(const std::vector<at::Tensor>& ts) {
  std::vector<const void*> out;
  for (const auto& t : ts) out.push_back(t.data_ptr());
  return out;
}
size_t total_bytes(const std::vector<at::Tensor>& ts) {
  size_t n = 0;
  for (const auto& t : ts) n += t.nbytes();
  return n;
}
std::vector<size_t> byte_counts(const std::vector<at::Tensor>& ts) {
  std::vector<size_t> out;
  for (const auto& t : ts) out.push_back(t.nbytes());
  return out;
}

}  // namespace

BackendPtr make_backend(std::shared_ptr<Store> store, int rank, int size,
                        const GroupOptions& options, std::string backend_name,
                        transport::Topology topology, bool host_slots, std::string label) {
  FabricBackend::Setup setup;
  setup.backend_name = std::move(backend_name);
  setup.topology = std::make_shared<const transport::Topology>(std::move(topology));
  auto& tcp = setup.fabric.tcp;
  tcp.local_address = options.local_address();
  tcp.streams = streams_from_env();
  tcp.timeout = options.timeout();
  tcp.name = options.name();
  tcp.token = store_auth::token_from_environment().value_or("");
  tcp.unexpected_bytes =
      static_cast<size_t>(*env::get_int(env::kTcpUnexpectedBytes, 65536, int64_t{1} << 50));
  tcp.unexpected_messages =
      static_cast<size_t>(*env::get_int(env::kTcpUnexpectedMessages, 1024, int64_t{1} << 32));
  setup.fabric.host_slots = host_slots;
  setup.fabric.label = std::move(label);
  return std::make_shared<FabricBackend>(std::move(store), rank, size, options, std::move(setup));
}

std::shared_ptr<ProcessGroup> cpu_group(int rank, int size, const GroupOptions& options,
                                        BackendPtr backend) {
  return std::make_shared<ProcessGroup>(rank, size, options,
                                        DeviceBackends{{c10::DeviceType::CPU, std::move(backend)}});
}

FabricBackend::FabricBackend(std::shared_ptr<Store> store, int rank, int size,
                                       GroupOptions options, Setup setup)
    : Backend(rank, size, std::move(options)),
      backend_name_(std::move(setup.backend_name)),
      topology_(std::move(setup.topology)),
      failures_(std::make_shared<FailureState>(raised_in_step)),
      collectives_(failures_) {
  algo_ = algorithms::all_reduce_algo_from_env();
  fabric_ = transport::connect(*store, rank, *topology_, setup.fabric);
  auto& transport = *fabric_.transport;
  // The transport's own state (its I/O threads see peers die) breaks the
  // group too; breaking the group fails the transport.
  failures_->watch([&transport] { return transport.error(); });
  failures_->on_break([&transport](const std::exception_ptr& error) { transport.fail(error); });
  if (algo_ != algorithms::AllReduceAlgo::kAuto && size > 1)
    DTRAIN_LOG_INFO(backend_name_, ": group '", name(), "' runs all_reduce as DTRAIN_ALGO=",
                    algorithms::to_string(algo_), " says, where it can");
  scratch_ = std::make_unique<algorithms::Scratch>();
  copy_ = std::make_unique<algorithms::Scratch>();
  rows_ = std::make_unique<algorithms::Scratch>();
}

// Queued collectives run first (each under its deadline); then point-to-
// point operations still pending (a send held back until its receive is
// posted, a receive whose message never came) fail with an error naming
// the destroyed group, instead of holding the destructor to their deadlines.
// With nothing pending, the connections close in order, so what this rank
// sent last still arrives (transport.h: close()).
FabricBackend::~FabricBackend() {
  collectives_.shutdown();
  fabric_.transport->close(std::make_exception_ptr(NetworkError(
      detail::cat("group '", name(), "' was destroyed while this operation was pending"))));
}

void FabricBackend::abort(std::exception_ptr error) {
  if (fabric_.host_slots) {  // a collective waiting in shared memory, and the host's peers
    std::string why = "the group was aborted";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      why = e.what();
    }
    fabric_.host_slots->abort(why);
  }
  failures_->break_with(error);
}

// Under the group's failure policy (core/failure_state.h): a broken group
// fails the Work at once; whatever else stops this rank mid-collective
// fails the transport too, so that peers do not wait for bytes that will
// never come.
WorkPtr FabricBackend::enqueue(const Call& call, size_t bytes,
                               std::function<void(const algorithms::Context&)> body) {
  auto run = [this, call, body = std::move(body)] {
    algorithms::Context ctx{*fabric_.transport, transport::collective_tag(call.seq),
                            transport::Clock::now() + call.timeout, call.description,
                            *scratch_, *copy_, *rows_, topology_.get(), algo_};
    ctx.slots = fabric_.host_slots.get();
    ctx.seq = call.seq;
    ctx.op = call.op;
    body(ctx);
  };
  if (size() == 1) {  // nothing to wait for: on the caller's thread
    run();
    return Work::completed(call.description);
  }
  auto work = std::make_shared<Work>(call.description);
  collectives_.submit(work, std::move(run), /*waiter_may_run=*/bytes <= kWaiterRunsBytes,
                      /*announce=*/!call.blocking);
  return work;
}

WorkPtr FabricBackend::do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) {
  check_reducible(call.description, tensor);
  return enqueue(call, tensor.nbytes(), [tensor, op](const algorithms::Context& ctx) {
    algorithms::all_reduce(ctx, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), op);
  });
}

WorkPtr FabricBackend::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  return enqueue(call, tensor.nbytes(), [tensor, root](const algorithms::Context& ctx) {
    algorithms::broadcast(ctx, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), root);
  });
}

WorkPtr FabricBackend::do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) {
  check_reducible(call.description, tensor);
  return enqueue(call, tensor.nbytes(), [tensor, root, op](const algorithms::Context& ctx) {
    algorithms::reduce(ctx, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), op, root);
  });
}

// The list forms, and the flat forms as rows of their flat tensor (the
// base class's views: the algorithms use contiguous rows in place).
WorkPtr FabricBackend::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                          at::Tensor input) {
  return enqueue(call, input.nbytes() * outputs.size(), [outputs, input](const algorithms::Context& ctx) {
    algorithms::all_gather(ctx, input.data_ptr(), count_of(input), input.scalar_type(),
                           pointers(outputs));
  });
}

WorkPtr FabricBackend::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                                      at::Tensor input, int root) {
  return enqueue(call, input.nbytes() * outputs.size(),
                 [outputs, input, root](const algorithms::Context& ctx) {
    algorithms::gather(ctx, input.data_ptr(), count_of(input), input.scalar_type(),
                       pointers(outputs), root);
  });
}

WorkPtr FabricBackend::do_scatter(const Call& call, at::Tensor output,
                                       std::vector<at::Tensor> inputs, int root) {
  return enqueue(call, output.nbytes() * inputs.size(),
                 [output, inputs, root](const algorithms::Context& ctx) {
    algorithms::scatter(ctx, const_pointers(inputs), output.data_ptr(), count_of(output),
                        output.scalar_type(), root);
  });
}

WorkPtr FabricBackend::do_reduce_scatter(const Call& call, at::Tensor output,
                                              std::vector<at::Tensor> inputs, ReduceOp op) {
  check_reducible(call.description, output);
  return enqueue(call, output.nbytes() * inputs.size(),
                 [output, inputs, op](const algorithms::Context& ctx) {
    algorithms::reduce_scatter(ctx, const_pointers(inputs), output.data_ptr(), count_of(output),
                               output.scalar_type(), op);
  });
}

WorkPtr FabricBackend::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                          std::vector<at::Tensor> inputs) {
  return enqueue(call, total_bytes(inputs) + total_bytes(outputs),
                 [outputs, inputs](const algorithms::Context& ctx) {
    algorithms::all_to_all(ctx, const_pointers(inputs), byte_counts(inputs), pointers(outputs),
                           byte_counts(outputs), inputs[0].scalar_type());
  });
}

WorkPtr FabricBackend::do_barrier(const Call& call) {
  return enqueue(call, 0, [](const algorithms::Context& ctx) { algorithms::barrier(ctx); });
}

WorkPtr FabricBackend::do_monitored_barrier(const Call& call, bool wait_all_ranks) {
  return enqueue(call, 0,
                 [timeout = call.timeout, wait_all_ranks](const algorithms::Context& ctx) {
    algorithms::monitored_barrier(ctx, timeout, wait_all_ranks);
  });
}

WorkPtr FabricBackend::do_send(const Call& call, at::Tensor tensor, int dst, int tag) {
  return post_p2p(call, std::move(tensor), dst, tag, /*is_send=*/true);
}

WorkPtr FabricBackend::do_recv(const Call& call, at::Tensor tensor, int src, int tag) {
  return post_p2p(call, std::move(tensor), src, tag, /*is_send=*/false);
}

WorkPtr FabricBackend::post_p2p(const Call& call, at::Tensor tensor, int peer, int tag,
                                  bool is_send) {
  DTRAIN_CHECK_ARG(size() > 1, call.description, ": a group of one rank has no peer to ",
                   is_send ? "send to" : "receive from");
  auto& transport = *fabric_.transport;
  auto work = std::make_shared<Work>(call.description);
  transport::RequestPtr request;
  try {
    const uint64_t t = transport::p2p_tag(tag);
    if (is_send) request = transport.isend(peer, t, tensor.data_ptr(), tensor.nbytes());
    else if (peer == kAnySource) request = transport.irecv_any(t, tensor.data_ptr(), tensor.nbytes());
    else request = transport.irecv(peer, t, tensor.data_ptr(), tensor.nbytes());
  } catch (const std::exception&) {
    if (!failures_->error()) throw;
    std::rethrow_exception(broken_group_error(call.description, failures_->error()));
  }
  // Posted above; each completes on its own (not in posting order), and
  // times out call.timeout after its first wait (completion_watcher.h).
  CompletionWatcher::Op op;
  op.work = work;
  op.timeout = call.timeout;
  op.test = [work, request, tensor, is_send, what = call.description] {
    if (!request->done()) return false;
    request->wait(transport::Clock::now(), what);  // returns, or throws its error
    if (!is_send) work->set_source_rank(request->source());
    return true;
  };
  op.expire = [request, what = call.description](CompletionWatcher::Clock::time_point deadline) {
    request->wait(deadline, what);
  };
  p2p_.add(std::move(op));
  request->on_done(p2p_.notifier());
  return work;
}

}  // namespace dtrain::fabric_backend
