#include "backends/gloo/backend.h"

#include <ATen/ATen.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <cstring>

#include "backends/gloo/reduce_ops.h"
#include "backends/gloo/store_adapter.h"
#include "common/enforce.h"
#include "core/average.h"
#include "common/logging.h"

namespace dtrain::gloo_backend {
namespace {

// Slot prefix for send/recv; Gloo's own collectives use 0x01..0x08.
constexpr uint8_t kSendRecvSlotPrefix = 0x18;

// Gloo's typed setters only use sizeof(T); pick an unsigned type of the
// tensor's element size.
template <typename F>
void with_element_type(const at::Tensor& t, F&& f) {
  switch (t.element_size()) {
    case 1: f(uint8_t{}); break;
    case 2: f(uint16_t{}); break;
    case 4: f(uint32_t{}); break;
    case 8: f(uint64_t{}); break;
    default: throw InternalError(detail::cat("gloo: unexpected element size ", t.element_size()));
  }
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Gloo reports transport failures as IoException; its timeouts say
// "Timed out". Both become dtrain types that name the operation.
std::exception_ptr translate(const std::string& what, std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const ::gloo::IoException& e) {
    std::string msg = e.what();
    if (msg.find("Timed out") != std::string::npos || msg.find("timed out") != std::string::npos)
      return std::make_exception_ptr(TimeoutError(what + " timed out: " + msg));
    return std::make_exception_ptr(
        NetworkError(what + " failed: " + msg + " (a peer may have exited or been killed)"));
  } catch (const ::gloo::EnforceNotMet& e) {
    return std::make_exception_ptr(InternalError(what + ": gloo check failed: " + e.what()));
  } catch (const ::gloo::Exception& e) {
    return std::make_exception_ptr(NetworkError(what + " failed: " + e.what()));
  } catch (...) {
    return std::current_exception();
  }
}


std::shared_ptr<::gloo::transport::Device> make_device(const GroupOptions& options) {
  ::gloo::transport::tcp::attr attr;
  attr.hostname = options.local_address().empty() ? "127.0.0.1" : options.local_address();
  return ::gloo::transport::tcp::CreateDevice(attr);
}

}  // namespace

GlooProcessGroup::GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                                   GroupOptions options)
    : ProcessGroup(rank, size, std::move(options)) {
  const auto what = detail::cat("gloo: connecting group '", name(), "' (rank ", rank, "/", size,
                                ", address ", this->options().local_address(), ")");
  try {
    device_ = make_device(this->options());
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout());
    StoreAdapter adapter(std::move(store));
    context->connectFullMesh(adapter, device_);
    context_ = std::move(context);
  } catch (const dtrain::Error&) {
    throw;
  } catch (...) {
    std::rethrow_exception(translate(what, std::current_exception()));
  }
  DTRAIN_LOG_INFO("gloo: group '", name(), "' connected, rank ", rank, "/", size, " via ",
                  device_->str());
}

GlooProcessGroup::~GlooProcessGroup() = default;

WorkPtr GlooProcessGroup::enqueue(const Call& call, std::function<void()> body) {
  auto work = std::make_shared<Work>(call.description);
  collectives_.submit([work, body = std::move(body), what = call.description] {
    std::exception_ptr error;
    try {
      body();
    } catch (...) {
      error = translate(what, std::current_exception());
    }
    work->finish(error);
  });
  return work;
}

void GlooProcessGroup::all_reduce_now(const Call& call, at::Tensor& flat, ReduceOp op) {
  if (flat.numel() == 0 || size() == 1) {
    if (op == ReduceOp::AVG) divide_for_average(flat, size());
    return;
  }
  ::gloo::AllreduceOptions opts(context_);
  with_element_type(flat, [&](auto t) {
    opts.setOutput(ptr<decltype(t)>(flat), static_cast<size_t>(flat.numel()));
  });
  opts.setReduceFunction(reduce_function(flat.scalar_type(), op));
  opts.setTag(static_cast<uint32_t>(call.seq));
  opts.setTimeout(call.timeout);
  ::gloo::allreduce(opts);
  if (op == ReduceOp::AVG) divide_for_average(flat, size());
}

WorkPtr GlooProcessGroup::do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) {
  return enqueue(call, [this, call, tensor, op]() mutable { all_reduce_now(call, tensor, op); });
}

WorkPtr GlooProcessGroup::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  return enqueue(call, [this, call, tensor, root] {
    if (tensor.numel() == 0 || size() == 1) return;
    ::gloo::BroadcastOptions opts(context_);
    with_element_type(tensor, [&](auto t) {
      opts.setOutput(ptr<decltype(t)>(tensor), static_cast<size_t>(tensor.numel()));
    });
    opts.setRoot(root);
    opts.setTag(static_cast<uint32_t>(call.seq));
    opts.setTimeout(call.timeout);
    ::gloo::broadcast(opts);
  });
}

WorkPtr GlooProcessGroup::do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) {
  return enqueue(call, [this, call, tensor, root, op] {
    // Gloo reduces in place on every rank; work on a copy so that only the
    // root's tensor changes.
    auto scratch = tensor.clone();
    if (scratch.numel() > 0 && size() > 1) {
      ::gloo::ReduceOptions opts(context_);
      with_element_type(scratch, [&](auto t) {
        opts.setOutput(ptr<decltype(t)>(scratch), static_cast<size_t>(scratch.numel()));
      });
      opts.setRoot(root);
      opts.setReduceFunction(reduce_function(scratch.scalar_type(), op));
      opts.setTag(static_cast<uint32_t>(call.seq));
      opts.setTimeout(call.timeout);
      ::gloo::reduce(opts);
    }
    if (rank() == root) {
      if (op == ReduceOp::AVG) divide_for_average(scratch, size());
      tensor.copy_(scratch);
    }
  });
}

WorkPtr GlooProcessGroup::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                        at::Tensor input) {
  return enqueue(call, [this, call, outputs, input] {
    const auto n = input.numel();
    if (n == 0) return;
    auto flat = at::empty({size() * n}, input.options());
    if (size() == 1) {
      flat.copy_(input.reshape({-1}));
    } else {
      ::gloo::AllgatherOptions opts(context_);
      with_element_type(input, [&](auto t) {
        using T = decltype(t);
        opts.setInput(ptr<T>(input), static_cast<size_t>(n));
        opts.setOutput(ptr<T>(flat), static_cast<size_t>(size() * n));
      });
      opts.setTag(static_cast<uint32_t>(call.seq));
      opts.setTimeout(call.timeout);
      ::gloo::allgather(opts);
    }
    for (int i = 0; i < size(); ++i) outputs[i].view({-1}).copy_(flat.narrow(0, i * n, n));
  });
}

WorkPtr GlooProcessGroup::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                                    at::Tensor input, int root) {
  return enqueue(call, [this, call, outputs, input, root] {
    const auto n = input.numel();
    if (n == 0) return;
    at::Tensor flat;
    if (size() == 1) {
      flat = input.reshape({-1});
    } else {
      ::gloo::GatherOptions opts(context_);
      with_element_type(input, [&](auto t) {
        using T = decltype(t);
        opts.setInput(ptr<T>(input), static_cast<size_t>(n));
        if (rank() == root) {
          flat = at::empty({size() * n}, input.options());
          opts.setOutput(ptr<T>(flat), static_cast<size_t>(size() * n));
        }
      });
      opts.setRoot(root);
      opts.setTag(static_cast<uint32_t>(call.seq));
      opts.setTimeout(call.timeout);
      ::gloo::gather(opts);
    }
    if (rank() == root)
      for (int i = 0; i < size(); ++i) outputs[i].view({-1}).copy_(flat.narrow(0, i * n, n));
  });
}

WorkPtr GlooProcessGroup::do_scatter(const Call& call, at::Tensor output,
                                     std::vector<at::Tensor> inputs, int root) {
  return enqueue(call, [this, call, output, inputs, root] {
    const auto n = output.numel();
    if (n == 0) return;
    if (size() == 1) {
      output.copy_(inputs[0].view_as(output));
      return;
    }
    ::gloo::ScatterOptions opts(context_);
    with_element_type(output, [&](auto t) {
      using T = decltype(t);
      if (rank() == root) {
        std::vector<T*> ptrs;
        for (const auto& in : inputs) ptrs.push_back(ptr<T>(in));
        opts.setInputs(ptrs, static_cast<size_t>(n));
      }
      opts.setOutput(ptr<T>(output), static_cast<size_t>(n));
    });
    opts.setRoot(root);
    opts.setTag(static_cast<uint32_t>(call.seq));
    opts.setTimeout(call.timeout);
    ::gloo::scatter(opts);
  });
}

WorkPtr GlooProcessGroup::do_reduce_scatter(const Call& call, at::Tensor output,
                                            std::vector<at::Tensor> inputs, ReduceOp op) {
  return enqueue(call, [this, call, output, inputs, op] {
    // All-reduce of the concatenated inputs, then keep this rank's chunk:
    // twice the traffic of a ring reduce-scatter, but exact for every dtype
    // and op (Gloo 0.5 has no generic reduce-scatter).
    std::vector<at::Tensor> flat_inputs;
    for (const auto& in : inputs) flat_inputs.push_back(in.reshape({-1}));
    auto flat = at::cat(flat_inputs);
    all_reduce_now(call, flat, op);
    const auto n = output.numel();
    output.view({-1}).copy_(flat.narrow(0, rank() * n, n));
  });
}

WorkPtr GlooProcessGroup::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                        std::vector<at::Tensor> inputs) {
  return enqueue(call, [this, call, outputs, inputs] {
    std::vector<int64_t> in_counts, out_counts;
    std::vector<at::Tensor> flat_inputs;
    for (const auto& in : inputs) {
      in_counts.push_back(in.numel());
      flat_inputs.push_back(in.reshape({-1}));
    }
    for (const auto& out : outputs) out_counts.push_back(out.numel());
    auto flat_in = at::cat(flat_inputs);
    auto flat_out = at::empty({std::accumulate(out_counts.begin(), out_counts.end(), int64_t{0})},
                              flat_in.options());
    if (size() == 1) {
      flat_out.copy_(flat_in);
    } else if (flat_in.numel() + flat_out.numel() > 0) {
      // Gloo wants real pointers even for empty buffers.
      auto in_buf = flat_in.numel() ? flat_in : at::empty({1}, flat_in.options());
      auto out_buf = flat_out.numel() ? flat_out : at::empty({1}, flat_out.options());
      ::gloo::AlltoallvOptions opts(context_);
      with_element_type(flat_in, [&](auto t) {
        using T = decltype(t);
        opts.setInput(ptr<T>(in_buf), in_counts);
        opts.setOutput(ptr<T>(out_buf), out_counts);
      });
      opts.setTag(static_cast<uint32_t>(call.seq));
      opts.setTimeout(call.timeout);
      ::gloo::alltoallv(opts);
    }
    int64_t offset = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      outputs[i].view({-1}).copy_(flat_out.narrow(0, offset, out_counts[i]));
      offset += out_counts[i];
    }
  });
}

WorkPtr GlooProcessGroup::do_barrier(const Call& call) {
  return enqueue(call, [this, call] {
    if (size() == 1) return;
    ::gloo::BarrierOptions opts(context_);
    opts.setTag(static_cast<uint32_t>(call.seq));
    opts.setTimeout(call.timeout);
    ::gloo::barrier(opts);
  });
}

WorkPtr GlooProcessGroup::do_send(const Call& call, at::Tensor tensor, int dst, int tag) {
  return post_p2p(call, std::move(tensor), dst, tag, /*is_send=*/true);
}

WorkPtr GlooProcessGroup::do_recv(const Call& call, at::Tensor tensor, int src, int tag) {
  return post_p2p(call, std::move(tensor), src, tag, /*is_send=*/false);
}

WorkPtr GlooProcessGroup::post_p2p(const Call& call, at::Tensor tensor, int peer, int tag,
                                   bool is_send) {
  auto work = std::make_shared<Work>(call.description);
  if (tensor.numel() == 0) {
    work->finish();
    return work;
  }
  std::shared_ptr<::gloo::transport::UnboundBuffer> buffer =
      context_->createUnboundBuffer(tensor.data_ptr(), tensor.nbytes());
  const auto slot = ::gloo::Slot::build(kSendRecvSlotPrefix, static_cast<uint32_t>(tag));
  try {
    if (is_send) {
      buffer->send(peer, slot);
    } else {
      buffer->recv(peer, slot);
    }
  } catch (...) {
    std::rethrow_exception(translate(call.description, std::current_exception()));
  }
  // Posted above; only the waiting happens in order on the second thread.
  p2p_waits_.submit([work, buffer, tensor, call, is_send] {
    std::exception_ptr error;
    try {
      bool done = is_send ? buffer->waitSend(call.timeout) : buffer->waitRecv(call.timeout);
      if (!done) throw NetworkError(call.description + " was aborted");
    } catch (...) {
      error = translate(call.description, std::current_exception());
    }
    work->finish(error);
  });
  return work;
}

}  // namespace dtrain::gloo_backend
