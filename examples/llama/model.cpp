// The Llama-style decoder of model.h.

#include "model.h"

#include <cmath>
#include <limits>

namespace llama {
namespace tp = dtrain::tensor_parallel;
namespace ep = dtrain::expert_parallel;
namespace {

// The column layers take the activations as they lie between the layers
// (sequence shards under SP); the row layers and the embedding give them
// back so.
tp::ParallelLinearOptions column_options(const Layout& l) {
  return tp::ParallelLinearOptions().bias(false).group(l.tp).input_layout(l.activations());
}
tp::ParallelLinearOptions row_options(const Layout& l) {
  return tp::ParallelLinearOptions().bias(false).group(l.tp).output_layout(l.activations());
}

// A bias-free Linear holding `weight` ([out, in]), for a parallel layer to take its shard of.
torch::nn::Linear linear_of(const at::Tensor& weight) {
  torch::nn::Linear full(torch::nn::LinearOptions(weight.size(1), weight.size(0)).bias(false));
  torch::NoGradGuard no_grad;
  full->weight.copy_(weight);
  return full;
}

const at::Tensor& value(const Values& v, const std::string& name) {
  const auto found = v.find(name);
  if (found == v.end()) throw std::invalid_argument("llama: no initial value for " + name);
  return found->second;
}

at::Tensor normal(at::Generator& gen, std::vector<int64_t> shape, double std) {
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat)) * std;
}

// A generator of its own per part of the model, so that what a stage draws
// does not depend on what the stages before it hold.
at::Generator generator_for(uint64_t seed, int64_t part) {
  return at::detail::createCPUGenerator(seed * 1000003 + static_cast<uint64_t>(part));
}

}  // namespace

Values initial_values(const Config& c, uint64_t seed, int64_t first_layer, int64_t last_layer,
                      bool embedding, bool head) {
  Values v;
  const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers));
  if (embedding) {
    auto gen = generator_for(seed, 0);
    v["tok_embeddings.weight"] = normal(gen, {c.vocab, c.dim}, 1.0);
  }
  for (int64_t i = first_layer; i < last_layer; ++i) {
    auto gen = generator_for(seed, 1 + i);
    const std::string p = "layers." + std::to_string(i) + ".";
    for (const char* w : {"wq", "wk", "wv"})
      v[p + "attention." + w + ".weight"] = normal(gen, {c.dim, c.dim}, 0.02);
    v[p + "attention.wo.weight"] = normal(gen, {c.dim, c.dim}, residual);
    if (c.experts == 0) {
      v[p + "feed_forward.w1.weight"] = normal(gen, {c.hidden, c.dim}, 0.02);
      v[p + "feed_forward.w3.weight"] = normal(gen, {c.hidden, c.dim}, 0.02);
      v[p + "feed_forward.w2.weight"] = normal(gen, {c.dim, c.hidden}, residual);
    } else {
      v[p + "moe.router.gate.weight"] = normal(gen, {c.experts, c.dim}, 0.02);
      v[p + "moe.experts.w1"] = normal(gen, {c.experts, c.hidden, c.dim}, 0.02);
      v[p + "moe.experts.w3"] = normal(gen, {c.experts, c.hidden, c.dim}, 0.02);
      v[p + "moe.experts.w2"] = normal(gen, {c.experts, c.dim, c.hidden}, residual);
      if (c.shared_expert) {
        v[p + "moe.shared_expert.w1.weight"] = normal(gen, {c.hidden, c.dim}, 0.02);
        v[p + "moe.shared_expert.w3.weight"] = normal(gen, {c.hidden, c.dim}, 0.02);
        v[p + "moe.shared_expert.w2.weight"] = normal(gen, {c.dim, c.hidden}, residual);
      }
    }
    v[p + "attention_norm.weight"] = at::ones({c.dim});
    v[p + "ffn_norm.weight"] = at::ones({c.dim});
  }
  if (head) {
    auto gen = generator_for(seed, 1 + c.layers);
    v["norm.weight"] = at::ones({c.dim});
    v["output.weight"] = normal(gen, {c.vocab, c.dim}, 1.0 / std::sqrt(static_cast<double>(c.dim)));
  }
  return v;
}

RMSNormImpl::RMSNormImpl(const at::Tensor& w, double eps) : eps_(eps) {
  weight = register_parameter("weight", w.clone());
}

at::Tensor RMSNormImpl::normalize(const at::Tensor& x, const at::Tensor& w) const {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * w;
}

AttentionImpl::AttentionImpl(const Config& c, const Layout& l, const Values& v, const std::string& prefix)
    : c_(c), l_(l), cp_(l.cp), ulysses_(l.ulysses) {
  const int64_t t = l.tp->size();
  if (c.dim % c.heads != 0 || (c.dim / c.heads) % 2 != 0)
    throw dtrain::InvalidArgument("llama Attention: dim " + std::to_string(c.dim) + " over " +
                                  std::to_string(c.heads) + " heads is not an even head size");
  if (c.heads % t != 0)
    throw dtrain::InvalidArgument("llama Attention: " + std::to_string(c.heads) +
                                  " heads do not split over a tensor-parallel group of " +
                                  std::to_string(t) + " ranks");
  local_heads_ = c.heads / t;
  const auto column = column_options(l);
  wq_ = register_module("wq", tp::ColumnParallelLinear(linear_of(value(v, prefix + "wq.weight")), column));
  wk_ = register_module("wk", tp::ColumnParallelLinear(linear_of(value(v, prefix + "wk.weight")), column));
  wv_ = register_module("wv", tp::ColumnParallelLinear(linear_of(value(v, prefix + "wv.weight")), column));
  wo_ = register_module("wo", tp::RowParallelLinear(linear_of(value(v, prefix + "wo.weight")), row_options(l)));
  // Rotary tables: position p turns the pair (2i, 2i + 1) by p / theta^(2i / head_dim).
  const int64_t hd = c.dim / c.heads;
  const auto inverse = 1.0 / torch::pow(c.rope_theta, torch::arange(0, hd, 2, torch::kFloat) / hd);
  const auto angles = torch::outer(torch::arange(c.seq, torch::kFloat), inverse);
  cos_ = angles.cos();
  sin_ = angles.sin();
}

namespace {

// x: [batch, sequence, heads, head_dim], each consecutive pair of features
// turned by the angles of its position: cos and sin hold one row per
// element of the sequence.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t s = x.size(1);
  const auto pairs = x.unflatten(-1, {x.size(-1) / 2, 2});
  const auto even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
  const auto c = cos.view({1, s, 1, -1}).to(x.device());
  const auto n = sin.view({1, s, 1, -1}).to(x.device());
  return torch::stack({even * c - odd * n, even * n + odd * c}, -1).flatten(-2);
}

}  // namespace

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  // One entry for the three projections: under SP one all-gather of the
  // whole sequence (this rank's part of it under CP), and in backward one
  // reduce-scatter of their summed gradients; this rank's heads.
  const auto in = tp::enter_column_region(x, l_.tp, l_.activations());
  auto q = wq_->forward_entered(in), k = wk_->forward_entered(in), v = wv_->forward_entered(in);
  const int64_t b = q.size(0), s = q.size(1), hd = c_.dim / c_.heads;
  const int64_t whole = cp_ ? s * cp_->size() : s;
  if (whole > c_.seq)
    throw dtrain::InvalidArgument("llama Attention: a sequence of " + std::to_string(whole) +
                                  " tokens, longer than the model's " + std::to_string(c_.seq));
  // The angles of the positions this rank holds: the first s, or under CP
  // its head and tail chunks'.
  const auto positions = cp_ ? dtrain::context_parallel::sequence_positions(whole, cp_) : torch::arange(s);
  const auto cos = cos_.index_select(0, positions), sin = sin_.index_select(0, positions);
  auto heads = [&](const at::Tensor& t) { return t.view({b, s, local_heads_, hd}); };
  q = rotate(heads(q), cos, sin).transpose(1, 2);  // [batch, heads, sequence, head_dim]
  k = rotate(heads(k), cos, sin).transpose(1, 2);
  v = heads(v).transpose(1, 2);
  return wo_(attend(q, k, v).transpose(1, 2).reshape({b, s, local_heads_ * hd}));
}

// Causal attention of [batch, heads, sequence, head_dim] parts: here, or
// over the context-parallel group.
at::Tensor AttentionImpl::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  namespace cp = dtrain::context_parallel;
  if (cp_) return ulysses_ ? cp::ulysses_attention(q, k, v, cp_) : cp::ring_attention(q, k, v, cp_);
  const int64_t s = q.size(2), hd = q.size(3);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  const auto future = torch::ones({s, s}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  auto probs = torch::softmax(scores.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
  if (c_.dropout > 0 && is_training()) {
    tp::ForkRng own(q.device());  // this rank's heads: a mask of its own
    probs = torch::dropout(probs, c_.dropout, true);
  }
  return torch::matmul(probs, v);
}

FeedForwardImpl::FeedForwardImpl(const Config& c, const Layout& l, const Values& v, const std::string& prefix)
    : l_(l) {
  if (c.hidden % l.tp->size() != 0)
    throw dtrain::InvalidArgument("llama FeedForward: hidden " + std::to_string(c.hidden) +
                                  " does not split over a tensor-parallel group of " +
                                  std::to_string(l.tp->size()) + " ranks");
  const auto column = column_options(l);
  w1_ = register_module("w1", tp::ColumnParallelLinear(linear_of(value(v, prefix + "w1.weight")), column));
  w2_ = register_module("w2", tp::RowParallelLinear(linear_of(value(v, prefix + "w2.weight")), row_options(l)));
  w3_ = register_module("w3", tp::ColumnParallelLinear(linear_of(value(v, prefix + "w3.weight")), column));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) {
  const auto in = tp::enter_column_region(x, l_.tp, l_.activations());  // gate and up: one entry
  return w2_(torch::silu(w1_->forward_entered(in)) * w3_->forward_entered(in));
}

namespace {

// The mixture of experts of layer `prefix`, holding the whole model's
// values (this rank's experts' slice of them).
ep::MoE moe_of(const Config& c, const Layout& l, const Values& v, const std::string& prefix) {
  auto options = ep::MoEOptions(c.dim, c.hidden, c.experts)
                     .top_k(c.top_k)
                     .score_func(ep::ScoreFunction::kSigmoid)
                     .route_norm(true)
                     .load_balance_coeff(c.balance_rate)
                     .shared_expert_hidden_dim(c.shared_expert ? c.hidden : 0)
                     .ep_group(l.ep)
                     .name(prefix.substr(0, prefix.size() - 1));  // "layers.3.moe"
  ep::MoE moe(options);
  torch::NoGradGuard no_grad;
  for (const auto& item : moe->named_parameters()) {
    at::Tensor whole = value(v, prefix + item.key());
    if (item.key().rfind("experts.", 0) == 0)
      whole = whole.narrow(0, moe->experts->first_expert(), moe->experts->local_experts());
    item.value().copy_(whole);
  }
  return moe;
}

}  // namespace

BlockImpl::BlockImpl(const Config& c, const Layout& l, const Values& v, int64_t index) : c_(c), l_(l) {
  const std::string p = "layers." + std::to_string(index) + ".";
  attention_norm_ = register_module("attention_norm", RMSNorm(value(v, p + "attention_norm.weight"), c.norm_eps));
  attention_ = register_module("attention", Attention(c, l, v, p + "attention."));
  ffn_norm_ = register_module("ffn_norm", RMSNorm(value(v, p + "ffn_norm.weight"), c.norm_eps));
  if (c.experts > 0)
    moe = register_module("moe", moe_of(c, l, v, p + "moe."));
  else
    feed_forward_ = register_module("feed_forward", FeedForward(c, l, v, p + "feed_forward."));
  // Under SP the norms see sequence shards: their gradients are summed
  // over TP, both in one call (forward). So does the mixture of experts
  // (whole on every TP rank, each routing its own shard's tokens): every
  // one of its gradients, the experts' too, is summed over the TP ranks.
  if (l.sequence_parallel && moe) tp::mark_sequence_parallel(*moe, l.tp);
}

// Whole activations (the same on every tensor-parallel rank) draw the same
// mask everywhere; sequence shards (SP) draw their own.
at::Tensor BlockImpl::residual_dropout(const at::Tensor& x) {
  if (c_.dropout <= 0 || !is_training()) return x;
  if (!l_.sequence_parallel) return torch::dropout(x, c_.dropout, true);
  tp::ForkRng own(x.device());
  return torch::dropout(x, c_.dropout, true);
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  std::vector<at::Tensor> norms{attention_norm_->weight, ffn_norm_->weight};
  if (l_.sequence_parallel) norms = tp::sum_gradients_together(norms, l_.tp);
  const auto h = x + residual_dropout(attention_(attention_norm_->normalize(x, norms[0])));
  const auto normed = ffn_norm_->normalize(h, norms[1]);
  return h + residual_dropout(moe ? moe(normed) : feed_forward_(normed));
}

StageImpl::StageImpl(const Config& c, const Layout& l, const Values& initial, int64_t first_layer,
                     int64_t last_layer, bool embedding, bool head)
    : l_(l) {
  if (embedding) {
    torch::nn::Embedding whole(c.vocab, c.dim);
    {
      torch::NoGradGuard no_grad;
      whole->weight.copy_(value(initial, "tok_embeddings.weight"));
    }
    tok_embeddings_ = register_module("tok_embeddings", tp::VocabParallelEmbedding(whole, row_options(l)));
  }
  auto layers = register_module("layers", std::make_shared<torch::nn::Module>());
  for (int64_t i = first_layer; i < last_layer; ++i)
    layers_.push_back(layers->register_module(std::to_string(i), Block(c, l, initial, i)));
  if (head) {
    norm_ = register_module("norm", RMSNorm(value(initial, "norm.weight"), c.norm_eps));
    output_ = register_module("output", tp::ColumnParallelLinear(linear_of(value(initial, "output.weight")),
                                                                 column_options(l)));
  }
}

at::Tensor StageImpl::forward(at::Tensor x) {
  if (tok_embeddings_) x = tok_embeddings_(x);
  dtrain::ActivationCheckpointOptions checkpoint;
  if (l_.keep_matmul_outputs) checkpoint.policy(dtrain::keep_matmul_outputs());
  for (auto& layer : layers_)
    x = l_.checkpoint ? dtrain::activation_checkpoint([&layer](at::Tensor in) { return layer(in); }, x, checkpoint)
                      : layer(x);
  if (output_) {
    auto w = norm_->weight;  // under SP summed over TP (it meets a sequence shard)
    if (l_.sequence_parallel) w = tp::sum_gradients_together({w}, l_.tp)[0];
    x = output_(norm_->normalize(x, w));
  }
  return x;
}

std::vector<ep::MoE> StageImpl::moes() const {
  std::vector<ep::MoE> out;
  for (const auto& layer : layers_)
    if (layer->moe) out.push_back(layer->moe);
  return out;
}

at::Tensor loss(const at::Tensor& logits_shard, const at::Tensor& targets,
                const std::shared_ptr<dtrain::ProcessGroup>& tp) {
  return tp::vocab_parallel_cross_entropy(logits_shard.reshape({-1, logits_shard.size(-1)}),
                                          targets.reshape({-1}), tp);
}

}  // namespace llama
