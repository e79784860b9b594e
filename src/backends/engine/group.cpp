#include "backends/engine/group.h"

#include <ATen/ATen.h>

#include <cstring>

#include "algorithms/collectives.h"
#include "algorithms/slots.h"
#include "algorithms/reduce_kernels.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "core/average.h"
#include "core/failure_state.h"
#include "dtrain/distributed.h"

namespace dtrain::engine_backend {
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

// Contiguous tensors (the base class stages the others) to and from raw
// staging memory; each returns the bytes copied.
size_t copy_bytes(uint8_t* dst, const at::Tensor& src) {
  if (src.nbytes()) std::memcpy(dst, src.data_ptr(), src.nbytes());
  return src.nbytes();
}
size_t copy_bytes(const at::Tensor& dst, const uint8_t* src) {
  if (dst.nbytes()) std::memcpy(dst.data_ptr(), src, dst.nbytes());
  return dst.nbytes();
}

}  // namespace

EngineProcessGroup::EngineProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                                       GroupOptions options, Carrier carrier)
    : ProcessGroup(rank, size, std::move(options)),
      backend_name_(std::move(carrier.backend_name)),
      topology_(std::move(carrier.topology)),
      failures_(std::make_shared<FailureState>(raised_in_step)),
      collectives_(failures_) {
  algo_ = algorithms::all_reduce_algo_from_env();
  if (size > 1) transport_ = carrier.connect(*store, rank, size, this->options());
  // The transport's own state (its I/O threads see peers die) breaks the
  // group too; breaking the group fails the transport.
  failures_->watch([this] { return transport_ ? transport_->error() : nullptr; });
  failures_->on_break([this](const std::exception_ptr& error) {
    if (transport_) transport_->fail(error);
  });
  // (Collectives over the transport's slots, shm's, do not take it.)
  if (algo_ != algorithms::AllReduceAlgo::kAuto && transport_ && !slots())
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
EngineProcessGroup::~EngineProcessGroup() {
  collectives_.shutdown();
  if (transport_)
    transport_->close(std::make_exception_ptr(NetworkError(detail::cat(
        "group '", name(), "' was destroyed while this operation was pending"))));
}

// Under the group's failure policy (core/failure_state.h): a broken group
// fails the Work at once; whatever else stops this rank mid-collective
// fails the transport too, so that peers do not wait for bytes that will
// never come.
WorkPtr EngineProcessGroup::enqueue(const Call& call,
                                   std::function<void(const algorithms::Context&)> body) {
  auto work = std::make_shared<Work>(call.description);
  collectives_.submit(work, [this, call, body = std::move(body)] {
    const algorithms::Context ctx{*transport_, transport::collective_tag(call.seq),
                                  transport::Clock::now() + call.timeout, call.description,
                                  *scratch_, *copy_, *rows_, topology_.get(), algo_};
    body(ctx);
  });
  return work;
}

WorkPtr EngineProcessGroup::enqueue_slots(
    const Call& call, std::function<void(const algorithms::slots::Call&)> body) {
  return enqueue(call, [this, call, body = std::move(body)](const algorithms::Context& ctx) {
    body(algorithms::slots::Call{*slots(), ctx.what, call.seq, call.op, ctx.deadline});
  });
}

WorkPtr EngineProcessGroup::do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) {
  check_reducible(call.description, tensor);
  if (size() == 1) {
    if (op == ReduceOp::AVG) divide_for_average(tensor, 1);
    return Work::completed(call.description);
  }
  if (slots())
    return enqueue_slots(call, [tensor, op](const algorithms::slots::Call& c) {
      algorithms::slots::all_reduce(c, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), op);
    });
  return enqueue(call, [this, tensor, op](const algorithms::Context& ctx) {
    algorithms::all_reduce(ctx, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), op);
    if (op == ReduceOp::AVG) divide_for_average(tensor, size());
  });
}

WorkPtr EngineProcessGroup::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  if (size() == 1) return Work::completed(call.description);
  if (slots())
    return enqueue_slots(call, [tensor, root](const algorithms::slots::Call& c) {
      algorithms::slots::broadcast(c, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), root);
    });
  return enqueue(call, [tensor, root](const algorithms::Context& ctx) {
    algorithms::broadcast(ctx, tensor.data_ptr(), tensor.nbytes(), root);
  });
}

WorkPtr EngineProcessGroup::do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) {
  check_reducible(call.description, tensor);
  if (size() == 1) return Work::completed(call.description);
  if (slots())
    return enqueue_slots(call, [tensor, root, op](const algorithms::slots::Call& c) {
      algorithms::slots::reduce(c, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), op, root);
    });
  return enqueue(call, [this, tensor, root, op](const algorithms::Context& ctx) {
    algorithms::reduce(ctx, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), op,
                       root);
    if (op == ReduceOp::AVG && rank() == root) divide_for_average(tensor, size());
  });
}

// Staging buffers come from the group's scratch (see algorithms::Scratch):
// a fresh tensor of that size would be page-faulted in on every call.

WorkPtr EngineProcessGroup::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                       at::Tensor input) {
  if (size() == 1) {
    outputs[0].view({-1}).copy_(input.reshape({-1}));
    return Work::completed(call.description);
  }
  if (slots())
    return enqueue_slots(call, [outputs, input](const algorithms::slots::Call& c) {
      algorithms::slots::gather(c, pointers(outputs), input.data_ptr(), count_of(input),
                                input.scalar_type(), -1);
    });
  return enqueue(call, [outputs, input](const algorithms::Context& ctx) {
    const size_t bytes = input.nbytes();
    uint8_t* flat = ctx.copy.get(bytes * outputs.size());
    algorithms::all_gather(ctx, input.data_ptr(), flat, bytes);
    for (size_t i = 0; i < outputs.size(); ++i) copy_bytes(outputs[i], flat + i * bytes);
  });
}

// Straight into the caller's flat output: no staging copy.
WorkPtr EngineProcessGroup::do_all_gather_into_tensor(const Call& call, at::Tensor output,
                                                   at::Tensor input) {
  if (size() == 1) {
    output.view({-1}).copy_(input.reshape({-1}));
    return Work::completed(call.description);
  }
  if (slots()) return ProcessGroup::do_all_gather_into_tensor(call, output, input);  // rows
  return enqueue(call, [output, input](const algorithms::Context& ctx) {
    algorithms::all_gather(ctx, input.data_ptr(), output.data_ptr(), input.nbytes());
  });
}

// The ring reduces in place: one copy of the input into scratch.
WorkPtr EngineProcessGroup::do_reduce_scatter_tensor(const Call& call, at::Tensor output,
                                                  at::Tensor input, ReduceOp op) {
  check_reducible(call.description, output);
  if (size() == 1) {
    output.view({-1}).copy_(input.reshape({-1}));
    return Work::completed(call.description);
  }
  if (slots()) return ProcessGroup::do_reduce_scatter_tensor(call, output, input, op);  // rows
  return enqueue(call, [this, output, input, op](const algorithms::Context& ctx) {
    uint8_t* work = ctx.copy.get(input.nbytes());
    copy_bytes(work, input);
    algorithms::reduce_scatter(ctx, work, output.data_ptr(), count_of(output),
                               output.scalar_type(), op);
    if (op == ReduceOp::AVG) divide_for_average(output, size());
  });
}

WorkPtr EngineProcessGroup::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                                   at::Tensor input, int root) {
  if (size() == 1) {
    outputs[0].view({-1}).copy_(input.reshape({-1}));
    return Work::completed(call.description);
  }
  if (slots())
    return enqueue_slots(call, [outputs, input, root](const algorithms::slots::Call& c) {
      algorithms::slots::gather(c, pointers(outputs), input.data_ptr(), count_of(input),
                                input.scalar_type(), root);
    });
  return enqueue(call, [this, outputs, input, root](const algorithms::Context& ctx) {
    const size_t bytes = input.nbytes();
    uint8_t* flat = rank() == root ? ctx.copy.get(bytes * size()) : nullptr;
    algorithms::gather(ctx, input.data_ptr(), flat, bytes, root);
    if (rank() == root)
      for (int i = 0; i < size(); ++i) copy_bytes(outputs[i], flat + i * bytes);
  });
}

WorkPtr EngineProcessGroup::do_scatter(const Call& call, at::Tensor output,
                                    std::vector<at::Tensor> inputs, int root) {
  if (size() == 1) {
    output.copy_(inputs[0].view_as(output));
    return Work::completed(call.description);
  }
  if (slots())
    return enqueue_slots(call, [output, inputs, root](const algorithms::slots::Call& c) {
      algorithms::slots::scatter(c, output.data_ptr(), const_pointers(inputs), count_of(output),
                                 output.scalar_type(), root);
    });
  return enqueue(call, [this, output, inputs, root](const algorithms::Context& ctx) {
    const size_t bytes = output.nbytes();
    uint8_t* flat = nullptr;
    if (rank() == root) {
      flat = ctx.copy.get(bytes * size());
      for (int i = 0; i < size(); ++i) copy_bytes(flat + i * bytes, inputs[i]);
    }
    algorithms::scatter(ctx, flat, output.data_ptr(), bytes, root);
  });
}

WorkPtr EngineProcessGroup::do_reduce_scatter(const Call& call, at::Tensor output,
                                           std::vector<at::Tensor> inputs, ReduceOp op) {
  check_reducible(call.description, output);
  if (size() == 1) {
    output.view({-1}).copy_(inputs[0].reshape({-1}));
    return Work::completed(call.description);
  }
  if (slots())
    return enqueue_slots(call, [output, inputs, op](const algorithms::slots::Call& c) {
      algorithms::slots::reduce_scatter(c, output.data_ptr(), const_pointers(inputs),
                                        count_of(output), output.scalar_type(), op);
    });
  return enqueue(call, [this, output, inputs, op](const algorithms::Context& ctx) {
    const size_t bytes = output.nbytes();
    uint8_t* work = ctx.copy.get(bytes * size());  // the ring reduces in place
    for (int i = 0; i < size(); ++i) copy_bytes(work + i * bytes, inputs[i]);
    algorithms::reduce_scatter(ctx, work, output.data_ptr(), count_of(output),
                               output.scalar_type(), op);
    if (op == ReduceOp::AVG) divide_for_average(output, size());
  });
}

WorkPtr EngineProcessGroup::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                       std::vector<at::Tensor> inputs) {
  if (size() == 1) {
    outputs[0].view({-1}).copy_(inputs[0].reshape({-1}));
    return Work::completed(call.description);
  }
  if (slots())
    return enqueue_slots(call, [outputs, inputs](const algorithms::slots::Call& c) {
      std::vector<size_t> in_bytes, out_bytes;
      for (const auto& in : inputs) in_bytes.push_back(in.nbytes());
      for (const auto& out : outputs) out_bytes.push_back(out.nbytes());
      algorithms::slots::all_to_all(c, pointers(outputs), out_bytes, const_pointers(inputs),
                                    in_bytes, inputs[0].scalar_type());
    });
  return enqueue(call, [outputs, inputs](const algorithms::Context& ctx) {
    std::vector<size_t> in_bytes, out_bytes;
    size_t in_total = 0, out_total = 0;
    for (const auto& in : inputs) in_total += in_bytes.emplace_back(in.nbytes());
    for (const auto& out : outputs) out_total += out_bytes.emplace_back(out.nbytes());
    uint8_t* flat_in = ctx.scratch.get(in_total);  // all_to_all uses no scratch itself
    uint8_t* flat_out = ctx.copy.get(out_total);
    size_t offset = 0;
    for (const auto& in : inputs) offset += copy_bytes(flat_in + offset, in);
    algorithms::all_to_all(ctx, flat_in, in_bytes, flat_out, out_bytes);
    offset = 0;
    for (const auto& out : outputs) offset += copy_bytes(out, flat_out + offset);
  });
}

WorkPtr EngineProcessGroup::do_barrier(const Call& call) {
  if (size() == 1) return Work::completed(call.description);
  if (slots())
    return enqueue_slots(call, [](const algorithms::slots::Call& c) { algorithms::slots::barrier(c); });
  return enqueue(call, [](const algorithms::Context& ctx) { algorithms::barrier(ctx); });
}

WorkPtr EngineProcessGroup::do_monitored_barrier(const Call& call, bool wait_all_ranks) {
  return enqueue(call, [timeout = call.timeout, wait_all_ranks](const algorithms::Context& ctx) {
    algorithms::monitored_barrier(ctx, timeout, wait_all_ranks);
  });
}

WorkPtr EngineProcessGroup::do_send(const Call& call, at::Tensor tensor, int dst, int tag) {
  return post_p2p(call, std::move(tensor), dst, tag, /*is_send=*/true);
}

WorkPtr EngineProcessGroup::do_recv(const Call& call, at::Tensor tensor, int src, int tag) {
  return post_p2p(call, std::move(tensor), src, tag, /*is_send=*/false);
}

WorkPtr EngineProcessGroup::post_p2p(const Call& call, at::Tensor tensor, int peer, int tag,
                                  bool is_send) {
  DTRAIN_CHECK_ARG(transport_, call.description, ": a group of one rank has no peer to ",
                   is_send ? "send to" : "receive from");
  auto work = std::make_shared<Work>(call.description);
  transport::RequestPtr request;
  try {
    const uint64_t t = transport::p2p_tag(tag);
    if (is_send) request = transport_->isend(peer, t, tensor.data_ptr(), tensor.nbytes());
    else if (peer == kAnySource) request = transport_->irecv_any(t, tensor.data_ptr(), tensor.nbytes());
    else request = transport_->irecv(peer, t, tensor.data_ptr(), tensor.nbytes());
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

}  // namespace dtrain::engine_backend
