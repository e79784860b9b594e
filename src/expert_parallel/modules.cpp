// The MoE modules of expert_parallel.h: the router, this rank's experts,
// the shared expert, and the layer that joins them. Their multiplies go
// through dtrain::linear, so that a selective checkpoint can keep them.

#include <torch/torch.h>

#include <cmath>

#include "common/enforce.h"
#include "ddp/model_sync.h"
#include "dtrain/activation_checkpoint.h"
#include "dtrain/distributed.h"
#include "dtrain/expert_parallel.h"

namespace dtrain::expert_parallel {
namespace {

constexpr const char* kModule = "expert_parallel::MoE";

// The options checked, with the group's rank a member.
MoEOptions checked(const MoEOptions& o) {
  DTRAIN_CHECK_ARG(o.dim() > 0 && o.hidden_dim() > 0, kModule, ": dim ", o.dim(), " and hidden_dim ",
                   o.hidden_dim(), " must be positive");
  DTRAIN_CHECK_ARG(o.num_experts() > 0, kModule, ": num_experts ", o.num_experts(), " must be positive");
  DTRAIN_CHECK_ARG(o.top_k() >= 1 && o.top_k() <= o.num_experts(), kModule, ": top_k ", o.top_k(),
                   " must be in 1..num_experts (", o.num_experts(), ")");
  DTRAIN_CHECK_ARG(o.shared_expert_hidden_dim() >= 0 && o.load_balance_coeff() >= 0, kModule,
                   ": shared_expert_hidden_dim and load_balance_coeff must not be negative");
  if (const auto& g = o.ep_group()) {
    DTRAIN_CHECK_ARG(g->rank() >= 0, kModule, ": this rank is not a member of group '", g->name(), "'");
    DTRAIN_CHECK_ARG(o.num_experts() % g->size() == 0, kModule, ": ", o.num_experts(),
                     " experts do not split over the ", g->size(), " ranks of group '", g->name(), "'");
  }
  return o;
}

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

}  // namespace

TokenChoiceTopKRouterImpl::TokenChoiceTopKRouterImpl(const MoEOptions& options) : options_(checked(options)) {
  gate = register_module("gate", linear(options_.dim(), options_.num_experts()));
}

Routing TokenChoiceTopKRouterImpl::forward(const at::Tensor& x, const at::Tensor& expert_bias) {
  const at::Tensor logits = dtrain::linear(x, gate->weight).to(at::kFloat);
  const at::Tensor scores =
      options_.score_func() == ScoreFunction::kSigmoid ? torch::sigmoid(logits) : torch::softmax(logits, 1);
  Routing r;
  if (expert_bias.defined()) {  // the bias chooses; the weights are the scores
    r.experts = std::get<1>(torch::topk(scores.detach() + expert_bias, options_.top_k(), 1));
    r.scores = scores.gather(1, r.experts);
  } else {
    std::tie(r.scores, r.experts) = torch::topk(scores, options_.top_k(), 1);
  }
  if (options_.route_norm()) r.scores = r.scores / (r.scores.sum(-1, true) + 1e-20);
  if (options_.route_scale() != 1.0) r.scores = r.scores * options_.route_scale();
  r.tokens_per_expert = torch::bincount(r.experts.reshape(-1), {}, options_.num_experts());
  return r;
}

GroupedExpertsImpl::GroupedExpertsImpl(const MoEOptions& options) : options_(checked(options)) {
  const int64_t e = options_.num_experts(), d = options_.dim(), h = options_.hidden_dim();
  const auto& g = options_.ep_group();
  local_ = g ? e / g->size() : e;
  first_ = g ? g->rank() * local_ : 0;
  // The whole experts, as one process makes them (Linear's default bounds),
  // then this rank's slice: every rank draws them all.
  torch::NoGradGuard no_grad;
  auto whole = [&](int64_t rows, int64_t cols) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(cols));
    return torch::empty({e, rows, cols}).uniform_(-bound, bound).narrow(0, first_, local_).clone();
  };
  w1 = register_parameter("w1", whole(h, d));
  w2 = register_parameter("w2", whole(d, h));
  w3 = register_parameter("w3", whole(h, d));
  // Each expert's gradient arrives summed over the group's ranks' tokens:
  // divided by their number, it is the gradient of their mean loss.
  if (g && g->size() > 1) {
    const double ranks = g->size();
    for (auto* w : {&w1, &w2, &w3}) w->register_hook([ranks](const at::Tensor& grad) { return grad / ranks; });
  }
}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& x, const std::vector<int64_t>& counts) {
  DTRAIN_CHECK_ARG(static_cast<int64_t>(counts.size()) == local_, kModule, ": ", counts.size(),
                   " expert counts for the ", local_, " experts of this rank");
  DTRAIN_CHECK_ARG(x.dim() == 2 && x.size(1) == options_.dim(), kModule, ": the experts' input is ", x.sizes(),
                   ", expected [rows, ", options_.dim(), "]");
  std::vector<at::Tensor> outs;
  int64_t at_row = 0;
  for (int64_t j = 0; j < local_; ++j) {  // every expert, tokens or none: a zero gradient, never an undefined one
    const at::Tensor rows = x.narrow(0, at_row, counts[j]);
    at_row += counts[j];
    const at::Tensor hidden = torch::silu(dtrain::linear(rows, w1[j])) * dtrain::linear(rows, w3[j]);
    outs.push_back(dtrain::linear(hidden, w2[j]));
  }
  DTRAIN_CHECK_ARG(at_row == x.size(0), kModule, ": the expert counts add up to ", at_row, " rows, the input has ",
                   x.size(0));
  return torch::cat(outs, 0);
}

std::vector<ParameterPlacement> GroupedExpertsImpl::parameter_placements() const {
  const int64_t e = options_.num_experts(), d = options_.dim(), h = options_.hidden_dim();
  return {{"w1", {e, h, d}, {first_, 0, 0}}, {"w2", {e, d, h}, {first_, 0, 0}}, {"w3", {e, h, d}, {first_, 0, 0}}};
}

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden_dim) {
  w1 = register_module("w1", linear(dim, hidden_dim));
  w2 = register_module("w2", linear(hidden_dim, dim));
  w3 = register_module("w3", linear(dim, hidden_dim));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) {
  return dtrain::linear(torch::silu(dtrain::linear(x, w1->weight)) * dtrain::linear(x, w3->weight), w2->weight);
}

MoEImpl::MoEImpl(const MoEOptions& options) : options_(checked(options)) {
  router = register_module("router", TokenChoiceTopKRouter(options_));
  experts = register_module("experts", GroupedExperts(options_));
  if (options_.shared_expert_hidden_dim() > 0)
    shared_expert =
        register_module("shared_expert", FeedForward(options_.dim(), options_.shared_expert_hidden_dim()));
  if (options_.load_balance_coeff() > 0) {
    expert_bias = register_buffer("expert_bias", torch::zeros({options_.num_experts()}));
    tokens_per_expert = register_buffer("tokens_per_expert", torch::zeros({options_.num_experts()}));
  }
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  DTRAIN_CHECK_ARG(x.dim() >= 1 && x.size(-1) == options_.dim(), kModule, ": the input's last dimension is ",
                   x.dim() >= 1 ? x.size(-1) : 0, ", expected dim ", options_.dim());
  // Every rank of the EP group must hold the same layer (experts, widths):
  // otherwise the counts and rows its peers send do not match what it
  // expects, and the dispatch fails at one rank's transport. Compared at
  // the first forward (which every rank of the group runs together; not at
  // construction, which is no collective), on every rank, naming what each
  // has.
  const auto& g = options_.ep_group();
  if (!compared_across_ranks_ && g && g->size() > 1) {
    std::vector<std::string> names;
    std::vector<at::Tensor> tensors;
    for (const auto& item : named_parameters()) names.push_back(item.key()), tensors.push_back(item.value());
    for (const auto& item : named_buffers()) names.push_back(item.key()), tensors.push_back(item.value());
    ddp::verify_same_model(*g, names, tensors, kModule);
  }
  compared_across_ranks_ = true;
  const at::Tensor flat = x.reshape({-1, options_.dim()});
  const Routing routing = router(flat, expert_bias);
  if (tokens_per_expert.defined()) {
    torch::NoGradGuard no_grad;
    tokens_per_expert.add_(routing.tokens_per_expert.to(tokens_per_expert.scalar_type()));
  }
  at::Tensor out = dispatch_and_combine(flat, routing, *experts, options_.ep_group(), options_.name());
  if (shared_expert) out = out + shared_expert(flat);
  return out.reshape(x.sizes());
}

void MoEImpl::update_expert_bias(const std::shared_ptr<ProcessGroup>& group) {
  if (!expert_bias.defined()) return;
  torch::NoGradGuard no_grad;
  at::Tensor counts = tokens_per_expert.clone();
  if (group && group->size() > 1) group->all_reduce(counts)->wait();
  at::Tensor delta = options_.load_balance_coeff() * torch::sign(counts.mean() - counts);
  expert_bias.add_(delta - delta.mean());
  tokens_per_expert.zero_();
}

std::vector<std::string> ignored_by_data_parallel(const torch::nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& item : model.named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    if (dynamic_cast<const GroupedExpertsImpl*>(item.value().get()))
      for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) names.push_back(prefix + p.key());
    if (const auto* moe = dynamic_cast<const MoEImpl*>(item.value().get()); moe && moe->tokens_per_expert.defined())
      names.push_back(prefix + "tokens_per_expert");
  }
  return names;
}

}  // namespace dtrain::expert_parallel
