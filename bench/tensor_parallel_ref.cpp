// dtrain-bench rank tp-ref: dtrain's tensor-parallel modules on the models,
// initial values and data of bench/scripts/tp_vs_pytorch.py, which runs
// PyTorch's parallelize_module on the same (run both with
// bench/scripts/tp_vs_pytorch.sh). The group is the whole world.
//
// Variants (each 5 AdamW steps, lr 1e-3):
//   mlp       Linear(16, 64) column-parallel, GELU, Linear(64, 16)
//             row-parallel, both with biases; mean squared error
//   llama     examples/llama's decoder (2 layers, dim 32, 4 heads, vocab
//             64, 8 tokens), vocabulary-parallel embedding and
//             cross-entropy (PyTorch's loss_parallel)
//   llama-sp  the same with sequence parallelism
//   llama-ac  the same without SP, each layer activation-checkpointed
// Each rank writes, under --out/<variant>/rank<r>/, float32 values:
// output (the first step's, this rank's part), loss (every step's),
// grad.<name> (this rank's part of each gradient, first step) and
// param.<name> (this rank's part of each parameter after the last step).

#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <sys/stat.h>

#include "dtrain/dtrain.h"
#include "model.h"
#include "ranks.h"

namespace dtrain::bench {
namespace {

namespace tp = tensor_parallel;
constexpr int kSteps = 5;
constexpr int64_t kBatch = 2, kSeq = 8;

// The value of the k-th parameter (by name, in sorted order) of shape
// `like`, from a formula tp_vs_pytorch.py repeats: norm weights near 1,
// matrices of about 1/sqrt(fan-in).
at::Tensor formula(int64_t k, const at::Tensor& like, bool norm) {
  const auto wave = (torch::arange(like.numel(), torch::kFloat) * (0.37 + 0.013 * static_cast<double>(k)) +
                     static_cast<double>(k)).sin().reshape(like.sizes());
  if (norm) return 1 + 0.2 * wave;
  return wave / std::sqrt(static_cast<double>(like.dim() > 1 ? like.size(1) : like.size(0)));
}

void write(const std::string& path, const at::Tensor& t) { write_float32(path, t); }

struct Run {
  std::function<at::Tensor()> output;                 // the forward of this step's input
  std::function<at::Tensor(const at::Tensor&)> loss;  // of that output
};

// Steps `model` as the variant says and writes what the comparison reads.
void train_and_write(torch::nn::Module& model, const Run& run, const std::string& dir,
                     const std::function<void(int)>& set_step) {
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-3));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    set_step(step);
    opt.zero_grad();
    const auto out = run.output();
    const auto l = run.loss(out);
    l.backward();
    losses.push_back(l.detach().reshape({1}));
    if (step == 0) {
      write(dir + "/output", out);
      for (const auto& p : model.named_parameters()) write(dir + "/grad." + p.key(), p.value().grad());
    }
    opt.step();
  }
  write(dir + "/loss", torch::cat(losses));
  for (const auto& p : model.named_parameters()) write(dir + "/param." + p.key(), p.value());
}

at::Tensor mlp_input(int step) {
  return (torch::arange(kBatch * kSeq * 16, torch::kFloat) * 0.05 + step).sin().reshape({kBatch, kSeq, 16});
}

at::Tensor mlp_target(int step) {
  return (torch::arange(kBatch * kSeq * 16, torch::kFloat) * 0.07 + 2 * step).cos().reshape({kBatch, kSeq, 16}) * 0.5;
}

void run_mlp(const std::shared_ptr<ProcessGroup>& g, const std::string& dir) {
  torch::nn::Linear up(16, 64), down(64, 16);
  {
    torch::NoGradGuard no_grad;  // names in sorted order: down.bias, down.weight, up.bias, up.weight
    down->bias.copy_(formula(0, down->bias, false));
    down->weight.copy_(formula(1, down->weight, false));
    up->bias.copy_(formula(2, up->bias, false));
    up->weight.copy_(formula(3, up->weight, false));
  }
  struct Mlp : torch::nn::Module {
    tp::ColumnParallelLinear up{nullptr};
    tp::RowParallelLinear down{nullptr};
  } mlp;
  mlp.up = mlp.register_module("up", tp::ColumnParallelLinear(up, tp::ParallelLinearOptions().group(g)));
  mlp.down = mlp.register_module("down", tp::RowParallelLinear(down, tp::ParallelLinearOptions().group(g)));
  int step = 0;
  Run run{[&] { return mlp.down(torch::gelu(mlp.up(mlp_input(step)))); },
          [&](const at::Tensor& out) { return torch::mse_loss(out, mlp_target(step)); }};
  train_and_write(mlp, run, dir, [&](int s) { step = s; });
}

at::Tensor tokens(int step, int64_t vocab, int shift) {
  return (torch::arange(kBatch * kSeq, torch::kLong) * 7 + 3 * step + shift).remainder(vocab).reshape({kBatch, kSeq});
}

void run_llama(const std::shared_ptr<ProcessGroup>& g, const std::string& dir, bool sp, bool ac) {
  llama::Config c;
  c.vocab = 64, c.dim = 32, c.layers = 2, c.heads = 4, c.hidden = 64, c.seq = kSeq;
  auto values = llama::initial_values(c, 0, 0, c.layers, true, true);
  int64_t k = 0;
  for (auto& [name, v] : values) {
    const bool norm = name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
    v = formula(k++, v, norm);
  }
  auto layout = llama::Layout::over(g);
  layout.sequence_parallel = sp;
  layout.checkpoint = ac;
  llama::Stage model(c, layout, values, 0, c.layers, true, true);
  int step = 0;
  Run run{[&] { return model(tokens(step, c.vocab, 0)); },
          [&](const at::Tensor& logits) { return llama::loss(logits, tokens(step, c.vocab, 1), g); }};
  train_and_write(*model, run, dir, [&](int s) { step = s; });
}

}  // namespace

void write_float32(const std::string& path, const at::Tensor& t) {
  const auto c = t.detach().to(torch::kFloat).contiguous();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot write " + path);
  std::fwrite(c.data_ptr<float>(), sizeof(float), static_cast<size_t>(c.numel()), f);
  std::fclose(f);
}

int tp_reference_rank_main(const Args& a) {
  init_process_group(InitOptions().backend(a.get("backend", "tcp")));
  torch::set_num_threads(1);
  auto g = default_group();
  const std::string out = a.get("out", "tp-ref");
  for (const std::string variant : {"mlp", "llama", "llama-sp", "llama-ac"}) {
    const std::string dir = out + "/" + variant + "/rank" + std::to_string(get_rank());
    for (const std::string& d : {out, out + "/" + variant, dir}) mkdir(d.c_str(), 0755);
    if (variant == "mlp") run_mlp(g, dir);
    else run_llama(g, dir, variant == "llama-sp", variant == "llama-ac");
  }
  destroy_process_group();
  return 0;
}

}  // namespace dtrain::bench
