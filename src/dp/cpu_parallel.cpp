// cpu mode: replicas on threads, forward and backward.
//
// Forward. Replica i gets chunk i of the input (a narrow view) and builds
// its own autograd graph on its own thread. Replica 0 is the original
// module, so its graph reaches the original parameters; replicas 1.. reach
// their parameter copies, which share the original storage and whose
// grad_fn leads to the original parameters (ReplicaSet::link_params). The
// outputs are concatenated, detached, into the result.
//
// Backward. If the result joined the caller's graph through a plain cat,
// the caller's backward would walk every replica's graph on one thread
// (the autograd engine runs all CPU work of a backward on the thread that
// called it). Instead the result's grad_fn is one node, ParallelBackward,
// whose next edges are the input and the original parameters. It cuts the
// incoming gradient like the outputs, and each pool thread differentiates
// its replica's graph with respect to its chunk and its parameters, where
// it stops, as torch::autograd::grad does but on the edges recorded at
// forward time (the engine supports concurrent
// backward calls from different threads; each runs on its caller's
// thread). grad() returns the gradients instead of accumulating them, so
// nothing touches .grad concurrently: the node sums each
// parameter's gradients in replica order (deterministic) and hands the sums
// to the original parameters' AccumulateGrad, once per parameter, exactly
// as a single forward would. The chunks' gradients, concatenated, go to the
// input. Inner graphs are freed as their backward goes, unless the outer
// backward keeps its graph (retain_graph) or one was ever built through them
// (create_graph, which the inner calls follow, as for double backward).

#include "dp/cpu_parallel.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>

#include <ATen/ThreadLocalState.h>

#include <cstdint>
#include <unordered_map>
#include <unordered_set>

#include "common/enforce.h"
#include "common/torch_compat.h"

namespace dtrain::dp {

namespace {

using torch::autograd::variable_list;

struct ParallelBackward : torch::autograd::Node {
  std::shared_ptr<ReplicaPool> pool;
  // Per replica, as at forward time (a later forward may relink the
  // replicas' tensors; the edges recorded here stay those of this graph):
  std::vector<torch::autograd::Edge> roots;      // its output's grad_fn; invalid: no graph
  std::vector<int64_t> rows;                     // its output's size along dim
  std::vector<torch::autograd::edge_list> wrt;   // [its chunk if input_grad] + parameters
  std::vector<std::vector<size_t>> targets;      // per parameter slot of wrt: next edge - 1
  std::vector<at::Tensor> chunks;                // for zero gradients (input_grad only)
  bool input_grad = false;
  int64_t dim = 0;
  bool released = false;
  bool differentiated = false;  // some backward through it had create_graph

  std::string name() const override { return "dtrain::DataParallelBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    roots.clear();
    wrt.clear();
    targets.clear();
    chunks.clear();
    released = true;
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!released,
                "Trying to backward through DataParallel's graph a second time; specify "
                "retain_graph=true if you need to backward through it again");
    variable_list result(num_outputs());
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return result;
    const bool create_graph = at::GradMode::is_enabled();
    // A graph built by create_graph runs through the replicas' graphs, and
    // a later backward over it may need them after this node has run again.
    differentiated = differentiated || create_graph;
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph() || differentiated;
    const size_t n = roots.size();
    std::vector<variable_list> partial(n);
    std::vector<std::function<void()>> tasks;
    const at::ThreadLocalState tls;
    int64_t offset = 0;
    for (size_t i = 0; i < n; ++i) {
      tasks.emplace_back([&, i, offset] {
        if (!roots[i].is_valid()) return;  // no parameter or input reached this output
        at::ThreadLocalStateGuard guard(tls);
        // What torch::autograd::grad(..., allow_unused=true) does, on edges.
        partial[i] = torch::autograd::Engine::get_default_engine().execute(
            {roots[i]}, {grad.narrow(dim, offset, rows[i])}, keep_graph, create_graph,
            /*accumulate_grad=*/false, wrt[i]);
      });
      offset += rows[i];
    }
    pool->run(tasks);

    auto part = [&](size_t i, size_t k) { return partial[i].empty() ? at::Tensor() : partial[i][k]; };
    if (input_grad) {
      variable_list pieces;
      for (size_t i = 0; i < n; ++i) {
        auto g = part(i, 0);
        pieces.push_back(g.defined() ? g : at::zeros_like(chunks[i]));
      }
      result[0] = at::cat(pieces, dim);
    }
    // In replica order, then slot order: deterministic sums.
    const size_t first = input_grad ? 1 : 0;
    for (size_t i = 0; i < n; ++i)
      for (size_t k = 0; k < targets[i].size(); ++k) {
        auto g = part(i, first + k);
        auto& total = result[1 + targets[i][k]];
        if (g.defined()) total = total.defined() ? total + g : g;
      }
    return result;
  }
};

// The parameters that receive gradients, each tensor once: parameters()
// lists a tensor registered in two places (tied weights) twice. `first`:
// the index of each distinct tensor; `entry`: each parameter's index into
// `first` (SIZE_MAX for none).
struct Trainable {
  std::vector<size_t> first;
  std::vector<size_t> entry;
};

Trainable trainable_of(const std::vector<at::Tensor>& params) {
  Trainable t;
  t.entry.assign(params.size(), SIZE_MAX);
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  for (size_t j = 0; j < params.size(); ++j) {
    if (!params[j].requires_grad()) continue;
    auto it = seen.emplace(params[j].unsafeGetTensorImpl(), t.first.size()).first;
    if (it->second == t.first.size()) t.first.push_back(j);
    t.entry[j] = it->second;
  }
  return t;
}

// The replicas' outputs, checked, detached and concatenated along `dim`;
// `any_graph`: whether any of them needs a gradient.
at::Tensor gathered(const std::vector<at::Tensor>& outputs, int64_t dim, bool& any_graph) {
  std::vector<at::Tensor> detached;
  for (size_t i = 0; i < outputs.size(); ++i) {
    DTRAIN_CHECK_ARG(outputs[i].defined(), "DataParallel: replica ", i,
                     " returned an undefined tensor");
    DTRAIN_CHECK_ARG(outputs[i].dim() > 0, "DataParallel: replica ", i,
                     " returned a scalar; outputs are gathered along dim ", dim,
                     ", so forward must return a tensor with at least one dimension");
    any_graph = any_graph || outputs[i].requires_grad();
    detached.push_back(outputs[i].detach());
  }
  return at::cat(detached, dim);
}

}  // namespace

at::Tensor cpu_parallel_forward(ReplicaSet& replicas, const std::shared_ptr<ReplicaPool>& pool,
                                const at::Tensor& input, const std::vector<int64_t>& sizes,
                                int64_t dim) {
  const size_t n = sizes.size();
  DTRAIN_ENFORCE(n >= 2 && n <= replicas.size() && n <= pool->size());
  replicas.refresh_state(n);
  replicas.link_params(n, /*share_storage=*/true);

  const bool grad_mode = at::GradMode::is_enabled();
  const bool input_grad = grad_mode && input.requires_grad();
  const auto original = replicas.params(0);
  const auto [trainable, target] = trainable_of(original);

  // Cut on this thread: the views' grad_fns (when the input requires grad)
  // link the chunks to the input's graph, which only double backward uses.
  std::vector<at::Tensor> chunks(n), outputs(n);
  int64_t offset = 0;
  for (size_t i = 0; i < n; ++i) {
    chunks[i] = input.narrow(dim, offset, sizes[i]);
    offset += sizes[i];
  }

  const at::ThreadLocalState tls;
  std::vector<std::function<void()>> tasks;
  for (size_t i = 0; i < n; ++i)
    tasks.emplace_back([&, i] {
      at::ThreadLocalStateGuard guard(tls);
      outputs[i] = replicas.forward(i, chunks[i]);
    });
  pool->run(tasks);

  bool any_graph = false;
  at::Tensor result = gathered(outputs, dim, any_graph);
  // Outputs can need gradients through tensors that are neither the input
  // nor parameters (say, a tensor captured by the module); those get none,
  // and if nothing else needs one there is no graph to build.
  if (!grad_mode || !any_graph || (!input_grad && trainable.empty())) return result;

  auto node = compat::make_node<ParallelBackward>();
  node->pool = pool;
  node->input_grad = input_grad;
  node->dim = dim;
  using torch::autograd::impl::gradient_edge;
  torch::autograd::edge_list edges;
  edges.push_back(input_grad ? gradient_edge(input) : torch::autograd::Edge());
  for (size_t j : trainable) edges.push_back(gradient_edge(original[j]));
  for (size_t i = 0; i < n; ++i) {
    node->roots.push_back(outputs[i].requires_grad() ? gradient_edge(outputs[i])
                                                     : torch::autograd::Edge());
    node->rows.push_back(outputs[i].size(dim));
    // Each of the replica's own tensors once (a clone may or may not share
    // tensors where the original does); all of them count for the original.
    const auto params = replicas.params(i);
    torch::autograd::edge_list wrt;
    std::vector<size_t> targets;
    std::unordered_set<const c10::TensorImpl*> own;
    if (input_grad) wrt.push_back(gradient_edge(chunks[i]));
    for (size_t j = 0; j < params.size(); ++j) {
      if (target[j] == SIZE_MAX || !own.insert(params[j].unsafeGetTensorImpl()).second) continue;
      wrt.push_back(gradient_edge(params[j]));
      targets.push_back(target[j]);
    }
    node->wrt.push_back(std::move(wrt));
    node->targets.push_back(std::move(targets));
  }
  if (input_grad) node->chunks = std::move(chunks);
  node->set_next_edges(std::move(edges));
  torch::autograd::set_history(result, node);
  return result;
}

}  // namespace dtrain::dp
