// dtrain-bench rank local-sgd-ref: dtrain's post-local SGD and DiLoCo
// (local_sgd.h) on the model, data and schedule of
// bench/scripts/local_sgd_vs_pytorch.py, which runs PyTorch's
// PostLocalSGDOptimizer + PeriodicModelAverager + post_localSGD_hook over
// gloo, and DiLoCo / Streaming DiLoCo written out in plain PyTorch (run
// both with bench/scripts/local_sgd_vs_pytorch.sh).
//
// The model: Linear(4, 6), tanh, Linear(6, 2), values from a formula; each
// rank its own batch per step (a formula of rank and step); mean squared
// error. --algo post-local: SGD (0.05, momentum 0.9), gradients averaged by
// DDP for 10 steps, then parameters averaged at step 10 and every 4th
// after, 50 steps. --algo diloco: AdamW (1e-2) inside, SGD (0.7, Nesterov
// 0.9) outside, sync every 4, 20 steps. --algo streaming: the same with
// the two layers as fragments, sync_delay 1, fragment_update_alpha 0.5, 21
// steps. Each rank writes its parameters after the last step, float32, to
// --out/rank<r>/param.<i>.

#include <torch/torch.h>

#include <string>
#include <sys/stat.h>

#include "dtrain/dtrain.h"
#include "dtrain/local_sgd.h"
#include "ranks.h"

namespace dtrain::bench {
namespace local_sgd_ref {  // (named: dtrain-bench is a unity build)

struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(4, 6));
    b = register_module("b", torch::nn::Linear(6, 2));
    torch::NoGradGuard no_grad;
    int64_t k = 0;
    for (auto& p : parameters())
      p.copy_((torch::arange(p.numel(), torch::kFloat) * 0.7 + static_cast<double>(++k)).sin().view_as(p) * 0.5);
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

std::pair<at::Tensor, at::Tensor> batch(int rank, int step) {
  const auto x = (torch::arange(12, torch::kFloat) * (0.31 + 0.07 * rank) + step).sin().view({3, 4});
  const auto y = (torch::arange(6, torch::kFloat) * (0.53 + 0.11 * rank) - step).cos().view({3, 2});
  return {x, y};
}

void post_local(Net& net, const std::shared_ptr<ProcessGroup>& g) {
  DistributedDataParallel ddp(net.ptr(), DDPOptions().process_group(g));
  ddp.register_comm_hook(local_sgd::post_local_sgd_hook(
      local_sgd::PostLocalSGDState().start_local_sgd_iter(10).post_local_gradient_allreduce(false)));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  local_sgd::PeriodicModelAverager averager(4, 10, g);
  local_sgd::PostLocalSGDOptimizer opt(sgd, averager);
  for (int step = 0; step < 50; ++step) {
    opt.zero_grad();
    auto [x, y] = batch(g->rank(), step);
    (ddp.forward(x) - y).pow(2).mean().backward();
    opt.step();
  }
}

void diloco(Net& net, const std::shared_ptr<ProcessGroup>& g, bool streaming) {
  torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::SGD outer(net->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
  std::vector<std::vector<at::Tensor>> fragments{net->parameters()};
  auto options = local_sgd::DiLoCoOptions().sync_every(4).group(g);
  if (streaming) {
    fragments = {net->a->parameters(), net->b->parameters()};
    options.sync_delay(1).fragment_update_alpha(0.5);
  }
  local_sgd::DiLoCo d(fragments, inner, outer, options);
  for (int step = 0; step < (streaming ? 21 : 20); ++step) {
    inner.zero_grad();
    auto [x, y] = batch(g->rank(), step);
    (net(x) - y).pow(2).mean().backward();
    d.step();
  }
}

int run(const Args& a) {
  init_process_group(InitOptions().backend(a.get("backend", "tcp")));
  torch::set_num_threads(1);
  auto g = default_group();
  const std::string algo = a.get("algo", "post-local"), out = a.get("out", "local-sgd-ref");
  const std::string dir = out + "/rank" + std::to_string(g->rank());
  for (const std::string& d : {out, dir}) mkdir(d.c_str(), 0755);
  Net net;
  if (algo == "post-local")
    post_local(net, g);
  else if (algo == "diloco" || algo == "streaming")
    diloco(net, g, algo == "streaming");
  else
    throw InvalidArgument("local-sgd-ref: --algo is post-local, diloco or streaming, not '" + algo + "'");
  int i = 0;
  for (const auto& p : net->parameters()) write_float32(dir + "/param." + std::to_string(i++), p);
  destroy_process_group();
  return 0;
}

}  // namespace local_sgd_ref

int local_sgd_reference_rank_main(const Args& a) { return local_sgd_ref::run(a); }

}  // namespace dtrain::bench
