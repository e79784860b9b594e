// The backend interface (dtrain/backend.h): the hooks' dispatch, shared by
// Backend and by groups that are their own backend, and Backend's defaults.

#include "dtrain/backend.h"

#include <ATen/ATen.h>

#include <limits>

#include "common/enforce.h"

namespace dtrain {
namespace detail {

WorkPtr OperationHooks::post(const Call& call, Op op) {
  auto& in = op.inputs;
  auto& out = op.outputs;
  switch (op.type) {
    case OpType::ALL_REDUCE: return do_all_reduce(call, out[0], op.reduce_op);
    case OpType::BROADCAST: return do_broadcast(call, out[0], op.root);
    case OpType::REDUCE: return do_reduce(call, out[0], op.root, op.reduce_op);
    case OpType::ALL_GATHER: return do_all_gather(call, std::move(out), in[0]);
    case OpType::GATHER: return do_gather(call, std::move(out), in[0], op.root);
    case OpType::SCATTER: return do_scatter(call, out[0], std::move(in), op.root);
    case OpType::REDUCE_SCATTER:
      return do_reduce_scatter(call, out[0], std::move(in), op.reduce_op);
    case OpType::ALL_GATHER_INTO_TENSOR: return do_all_gather_into_tensor(call, out[0], in[0]);
    case OpType::REDUCE_SCATTER_TENSOR:
      return do_reduce_scatter_tensor(call, out[0], in[0], op.reduce_op);
    case OpType::ALL_TO_ALL: return do_all_to_all(call, std::move(out), std::move(in));
    case OpType::BARRIER: return do_barrier(call);
    case OpType::MONITORED_BARRIER: return do_monitored_barrier(call, op.wait_all_ranks);
    case OpType::SEND: return do_send(call, in[0], op.root, op.tag);
    case OpType::RECV: return do_recv(call, out[0], op.root, op.tag);
  }
  throw InternalError(detail::cat(call.description, ": unknown operation type"));
}

std::vector<WorkPtr> OperationHooks::post_batch(const std::vector<Call>& calls,
                                                std::vector<Op> ops) {
  std::vector<WorkPtr> works;
  for (size_t i = 0; i < ops.size(); ++i) works.push_back(post(calls[i], std::move(ops[i])));
  return works;
}

namespace {

[[noreturn]] void not_implemented(const std::string& owner, const char* op) {
  throw BackendUnavailable(detail::cat(owner, " does not implement ", op));
}

// `flat`'s n rows as tensors shaped like `piece` (views, no copy).
std::vector<at::Tensor> rows_of(const at::Tensor& flat, const at::Tensor& piece, int n) {
  auto rows = flat.view({n, piece.numel()}).unbind(0);
  std::vector<at::Tensor> out;
  out.reserve(rows.size());
  for (auto& r : rows) out.push_back(r.view(piece.sizes()));
  return out;
}

}  // namespace

WorkPtr OperationHooks::do_all_reduce(const Call&, at::Tensor, ReduceOp) {
  not_implemented(hooks_owner(), "all_reduce");
}
WorkPtr OperationHooks::do_broadcast(const Call&, at::Tensor, int) {
  not_implemented(hooks_owner(), "broadcast");
}
WorkPtr OperationHooks::do_reduce(const Call&, at::Tensor, int, ReduceOp) {
  not_implemented(hooks_owner(), "reduce");
}
WorkPtr OperationHooks::do_all_gather(const Call&, std::vector<at::Tensor>, at::Tensor) {
  not_implemented(hooks_owner(), "all_gather");
}
WorkPtr OperationHooks::do_gather(const Call&, std::vector<at::Tensor>, at::Tensor, int) {
  not_implemented(hooks_owner(), "gather");
}
WorkPtr OperationHooks::do_scatter(const Call&, at::Tensor, std::vector<at::Tensor>, int) {
  not_implemented(hooks_owner(), "scatter");
}
WorkPtr OperationHooks::do_reduce_scatter(const Call&, at::Tensor, std::vector<at::Tensor>,
                                        ReduceOp) {
  not_implemented(hooks_owner(), "reduce_scatter");
}
WorkPtr OperationHooks::do_all_to_all(const Call&, std::vector<at::Tensor>,
                                    std::vector<at::Tensor>) {
  not_implemented(hooks_owner(), "all_to_all");
}
WorkPtr OperationHooks::do_barrier(const Call&) { not_implemented(hooks_owner(), "barrier"); }
WorkPtr OperationHooks::do_monitored_barrier(const Call&, bool) {
  not_implemented(hooks_owner(), "monitored_barrier");
}
WorkPtr OperationHooks::do_send(const Call&, at::Tensor, int, int) { not_implemented(hooks_owner(), "send"); }
WorkPtr OperationHooks::do_recv(const Call&, at::Tensor, int, int) { not_implemented(hooks_owner(), "recv"); }

// The flat forms, by default: the list forms on views of the flat tensor.
WorkPtr OperationHooks::do_all_gather_into_tensor(const Call& call, at::Tensor output,
                                                at::Tensor input) {
  auto rows = rows_of(output, input, hooks_group_size());  // before `input` is moved from
  return do_all_gather(call, std::move(rows), std::move(input));
}

WorkPtr OperationHooks::do_reduce_scatter_tensor(const Call& call, at::Tensor output,
                                               at::Tensor input, ReduceOp op) {
  auto rows = rows_of(input, output, hooks_group_size());  // before `output` is moved from
  return do_reduce_scatter(call, std::move(output), std::move(rows), op);
}

}  // namespace detail

Backend::Backend(int rank, int size, GroupOptions options)
    : rank_(rank), size_(size), options_(std::move(options)) {}

Backend::~Backend() = default;

int Backend::max_tag() const { return std::numeric_limits<int>::max(); }

bool Backend::averages(c10::ScalarType) const { return false; }

void Backend::abort(std::exception_ptr) {
  throw BackendUnavailable(detail::cat("the ", backend_name(), " backend of group '", name(),
                                       "' cannot abort a group (only the whole job, through the launcher)"));
}

std::string Backend::hooks_owner() const {
  return detail::cat("backend '", backend_name(), "' (group '", name(), "')");
}

}  // namespace dtrain
