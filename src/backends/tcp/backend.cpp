#include "backends/tcp/backend.h"

#include <ATen/ATen.h>

#include <numeric>
#include <thread>

#include "algorithms/collectives.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "core/average.h"
#include "transport/tcp/transport.h"

namespace dtrain::tcp_backend {
namespace {

// The reductions the kernels implement; anything else is refused before a
// byte is sent, so that no rank is left waiting.
void check_reducible(const std::string& what, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kInt: case at::kLong: case at::kByte: case at::kChar:
      return;
    default:
      throw InvalidArgument(detail::cat(what, ": tcp cannot reduce tensors of dtype ",
                                        c10::toString(t.scalar_type()),
                                        " (supported: float, double, half, bfloat16, int8, "
                                        "uint8, int32, int64)"));
  }
}

size_t count_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()); }

// DTRAIN_TCP_STREAMS; "auto": a second stream (and I/O thread) pays off only
// where cores are left for it (measured: on 2 cores one stream is faster).
int streams_from_env() {
  if (env::get(env::kTcpStreams).value_or("auto") == "auto")
    return std::thread::hardware_concurrency() > 4 ? 2 : 1;
  return static_cast<int>(*env::get_int(env::kTcpStreams, 1, 16));
}

}  // namespace

struct TcpProcessGroup::Op {
  algorithms::Context ctx;
};

TcpProcessGroup::TcpProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                                 GroupOptions options)
    : ProcessGroup(rank, size, std::move(options)) {
  if (size > 1) {
    transport::TcpOptions t;
    t.local_address = this->options().local_address();
    t.streams = streams_from_env();
    t.timeout = timeout();
    t.name = name();
    transport_ = transport::connect_tcp(*store, rank, size, t);
  }
  scratch_ = std::make_unique<algorithms::Scratch>();
  copy_ = std::make_unique<algorithms::Scratch>();
  DTRAIN_LOG_INFO("tcp: group '", name(), "' connected, rank ", rank, "/", size, " via ",
                  this->options().local_address().empty() ? "127.0.0.1"
                                                          : this->options().local_address());
}

TcpProcessGroup::~TcpProcessGroup() = default;

WorkPtr TcpProcessGroup::enqueue(const Call& call, std::function<void(const Op&)> body) {
  auto work = std::make_shared<Work>(call.description);
  collectives_.submit([this, work, call, body = std::move(body)] {
    std::exception_ptr error = transport_ ? transport_->error() : nullptr;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        error = std::make_exception_ptr(NetworkError(detail::cat(
            call.description, " cannot run: the group is broken by an earlier error (", e.what(),
            "); destroy it and create a new one")));
      }
      work->finish(error);
      return;
    }
    try {
      Op op{algorithms::Context{*transport_, transport::collective_tag(call.seq),
                                transport::Clock::now() + call.timeout, call.description,
                                *scratch_, *copy_}};
      body(op);
    } catch (...) {
      error = std::current_exception();
      // Whatever stopped this rank mid-collective stops the group: peers
      // must not wait for bytes that will never come.
      if (transport_) transport_->fail(error);
    }
    work->finish(error);
  });
  return work;
}

WorkPtr TcpProcessGroup::do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) {
  check_reducible(call.description, tensor);
  if (size() == 1) {
    if (op == ReduceOp::AVG) divide_for_average(tensor, 1);
    return Work::completed(call.description);
  }
  return enqueue(call, [this, tensor, op](const Op& o) {
    algorithms::all_reduce(o.ctx, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), op);
    if (op == ReduceOp::AVG) divide_for_average(tensor, size());
  });
}

WorkPtr TcpProcessGroup::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  if (size() == 1) return Work::completed(call.description);
  return enqueue(call, [tensor, root](const Op& o) {
    algorithms::broadcast(o.ctx, tensor.data_ptr(), tensor.nbytes(), root);
  });
}

WorkPtr TcpProcessGroup::do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) {
  check_reducible(call.description, tensor);
  if (size() == 1) return Work::completed(call.description);
  return enqueue(call, [this, tensor, root, op](const Op& o) {
    algorithms::reduce(o.ctx, tensor.data_ptr(), count_of(tensor), tensor.scalar_type(), op,
                       root);
    if (op == ReduceOp::AVG && rank() == root) divide_for_average(tensor, size());
  });
}

WorkPtr TcpProcessGroup::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                       at::Tensor input) {
  if (size() == 1) {
    outputs[0].view({-1}).copy_(input.reshape({-1}));
    return Work::completed(call.description);
  }
  return enqueue(call, [this, outputs, input](const Op& o) {
    const auto n = input.numel();
    auto flat = at::empty({size() * n}, input.options());
    algorithms::all_gather(o.ctx, input.data_ptr(), flat.data_ptr(), input.nbytes());
    for (int i = 0; i < size(); ++i) outputs[i].view({-1}).copy_(flat.narrow(0, i * n, n));
  });
}

WorkPtr TcpProcessGroup::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                                   at::Tensor input, int root) {
  if (size() == 1) {
    outputs[0].view({-1}).copy_(input.reshape({-1}));
    return Work::completed(call.description);
  }
  return enqueue(call, [this, outputs, input, root](const Op& o) {
    const auto n = input.numel();
    at::Tensor flat;
    if (rank() == root) flat = at::empty({size() * n}, input.options());
    algorithms::gather(o.ctx, input.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr,
                       input.nbytes(), root);
    if (rank() == root)
      for (int i = 0; i < size(); ++i) outputs[i].view({-1}).copy_(flat.narrow(0, i * n, n));
  });
}

WorkPtr TcpProcessGroup::do_scatter(const Call& call, at::Tensor output,
                                    std::vector<at::Tensor> inputs, int root) {
  if (size() == 1) {
    output.copy_(inputs[0].view_as(output));
    return Work::completed(call.description);
  }
  return enqueue(call, [this, output, inputs, root](const Op& o) {
    at::Tensor flat;
    if (rank() == root) {
      std::vector<at::Tensor> flat_inputs;
      for (const auto& in : inputs) flat_inputs.push_back(in.reshape({-1}));
      flat = at::cat(flat_inputs);
    }
    algorithms::scatter(o.ctx, flat.defined() ? flat.data_ptr() : nullptr, output.data_ptr(),
                        output.nbytes(), root);
  });
}

WorkPtr TcpProcessGroup::do_reduce_scatter(const Call& call, at::Tensor output,
                                           std::vector<at::Tensor> inputs, ReduceOp op) {
  check_reducible(call.description, output);
  if (size() == 1) {
    output.view({-1}).copy_(inputs[0].reshape({-1}));
    return Work::completed(call.description);
  }
  return enqueue(call, [this, output, inputs, op](const Op& o) {
    std::vector<at::Tensor> flat_inputs;
    for (const auto& in : inputs) flat_inputs.push_back(in.reshape({-1}));
    auto flat = at::cat(flat_inputs);  // the ring's scratch
    algorithms::reduce_scatter(o.ctx, flat.data_ptr(), output.data_ptr(), count_of(output),
                               output.scalar_type(), op);
    if (op == ReduceOp::AVG) divide_for_average(output, size());
  });
}

WorkPtr TcpProcessGroup::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                       std::vector<at::Tensor> inputs) {
  if (size() == 1) {
    outputs[0].view({-1}).copy_(inputs[0].reshape({-1}));
    return Work::completed(call.description);
  }
  return enqueue(call, [outputs, inputs](const Op& o) {
    std::vector<size_t> in_bytes, out_bytes;
    std::vector<at::Tensor> flat_inputs;
    for (const auto& in : inputs) {
      in_bytes.push_back(in.nbytes());
      flat_inputs.push_back(in.reshape({-1}));
    }
    int64_t out_count = 0;
    for (const auto& out : outputs) {
      out_bytes.push_back(out.nbytes());
      out_count += out.numel();
    }
    auto flat_in = at::cat(flat_inputs);
    auto flat_out = at::empty({out_count}, flat_in.options());
    algorithms::all_to_all(o.ctx, flat_in.data_ptr(), in_bytes, flat_out.data_ptr(), out_bytes);
    int64_t offset = 0;
    for (const auto& out : outputs) {
      out.view({-1}).copy_(flat_out.narrow(0, offset, out.numel()));
      offset += out.numel();
    }
  });
}

WorkPtr TcpProcessGroup::do_barrier(const Call& call) {
  if (size() == 1) return Work::completed(call.description);
  return enqueue(call, [](const Op& o) { algorithms::barrier(o.ctx); });
}

WorkPtr TcpProcessGroup::do_send(const Call& call, at::Tensor tensor, int dst, int tag) {
  return post_p2p(call, std::move(tensor), dst, tag, /*is_send=*/true);
}

WorkPtr TcpProcessGroup::do_recv(const Call& call, at::Tensor tensor, int src, int tag) {
  return post_p2p(call, std::move(tensor), src, tag, /*is_send=*/false);
}

WorkPtr TcpProcessGroup::post_p2p(const Call& call, at::Tensor tensor, int peer, int tag,
                                  bool is_send) {
  DTRAIN_CHECK_ARG(transport_, call.description, ": a group of one rank has no peer to ",
                   is_send ? "send to" : "receive from");
  auto work = std::make_shared<Work>(call.description);
  transport::RequestPtr request;
  try {
    request = is_send ? transport_->isend(peer, transport::p2p_tag(tag), tensor.data_ptr(),
                                          tensor.nbytes())
                      : transport_->irecv(peer, transport::p2p_tag(tag), tensor.data_ptr(),
                                          tensor.nbytes());
  } catch (const std::exception& e) {
    if (!transport_->error()) throw;
    throw NetworkError(detail::cat(call.description,
                                   " cannot run: the group is broken by an earlier error (",
                                   e.what(), "); destroy it and create a new one"));
  }
  // Posted above; only the waiting happens in order on the second thread.
  const auto deadline = transport::Clock::now() + call.timeout;
  p2p_waits_.submit([work, request, tensor, deadline, what = call.description] {
    std::exception_ptr error;
    try {
      request->wait(deadline, what);
    } catch (...) {
      error = std::current_exception();
    }
    work->finish(error);
  });
  return work;
}

}  // namespace dtrain::tcp_backend
