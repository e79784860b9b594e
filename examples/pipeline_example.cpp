// Pipeline parallelism on Fashion-MNIST: a 4-stage model on 2 pipeline
// ranks (two stages each, ScheduleInterleaved1F1B) x 2 data-parallel ranks
// (each stage wrapped in DDP over the mesh's "dp" group). Run it with
//   dtrain-run --standalone --nproc-per-node 4 ./pipeline_example [--steps N]
#include <dtrain/data/fashion_mnist.h>
#include <dtrain/dtrain.h>
#include <torch/torch.h>

#include <cstring>
#include <iostream>
#include <string>

namespace pp = dtrain::pipelining;
using Stage = dtrain::DistributedDataParallel<torch::nn::SequentialImpl>;

torch::nn::Sequential make_model() {
  torch::manual_seed(0);  // every rank builds the same model
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 256),
                               torch::nn::ReLU(), torch::nn::Linear(256, 128), torch::nn::ReLU(),
                               torch::nn::Linear(128, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 10));
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits, labels);
}

int main(int argc, char** argv) {
  int64_t max_steps = -1;  // one epoch
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--steps") == 0) max_steps = std::stoll(argv[i + 1]);
  dtrain::init_process_group();
  auto mesh = dtrain::init_device_mesh({2, 2}, {"pp", "dp"});
  const int pp_rank = mesh.get_local_rank("pp"), dp_rank = mesh.get_local_rank("dp");

  // Stages 0..3 (split before children 2, 4 and 6); this rank runs stages
  // pp_rank and pp_rank + 2, each in DDP over its data-parallel replicas.
  auto pieces = pp::split_sequential(make_model(), std::vector<int>{2, 4, 6});
  std::vector<pp::PipelineStage> stages;
  std::vector<torch::Tensor> params;
  for (int s : {pp_rank, pp_rank + 2}) {
    auto ddp = std::make_shared<Stage>(
        pieces[s].ptr(), dtrain::DDPOptions().process_group(mesh.get_group("dp")));
    for (auto& p : ddp->parameters()) params.push_back(p);
    stages.emplace_back(ddp, s, 4, pp::PipelineStageOptions().group(mesh.get_group("pp")));
  }
  pp::ScheduleInterleaved1F1B schedule(stages, /*n_microbatches=*/4, cross_entropy);
  torch::optim::Adam opt(params, 1e-3);
  const bool first = pp_rank == 0, last = pp_rank == 1;  // stage 0 / stage 3
  const bool reports = last && dp_rank == 0;

  // Each data-parallel replica reads its half of the training set; both
  // pipeline ranks of a replica draw the same batches.
  dtrain::FashionMNIST train;
  dtrain::DistributedSampler sampler(
      train.images().size(0), dtrain::DistributedSamplerOptions().num_replicas(2).rank(dp_rank));
  const int64_t batch = 64, steps = static_cast<int64_t>(sampler.num_samples()) / batch;
  const int64_t run = max_steps > 0 ? std::min(max_steps, steps) : steps;
  for (int64_t step = 0; step < run; ++step) {
    auto indices = *sampler.next(batch);
    auto idx = torch::tensor(std::vector<int64_t>(indices.begin(), indices.end()));
    opt.zero_grad();
    std::vector<at::Tensor> losses;
    if (first) schedule.step(train.images().index_select(0, idx));
    else schedule.step(train.targets().index_select(0, idx), &losses);
    opt.step();
    if (reports && (step + 1) % 50 == 0)
      std::cout << "step " << step + 1 << "/" << run << "  loss "
                << torch::stack(losses).mean().item<double>() << std::endl;
  }

  // Test accuracy: forwards only, each replica on half of the test set.
  dtrain::FashionMNIST test(dtrain::FashionMNIST::kDefaultRoot, dtrain::FashionMNIST::Mode::kTest);
  auto correct = torch::zeros({1}, torch::kLong);
  const int64_t half = test.images().size(0) / 2, eval_batch = 500;
  for (int64_t at = dp_rank * half; at < (dp_rank + 1) * half; at += eval_batch) {
    auto logits = first ? schedule.eval(test.images().narrow(0, at, eval_batch))
                        : schedule.eval(test.targets().narrow(0, at, eval_batch));
    if (last) correct += (logits.argmax(1) == test.targets().narrow(0, at, eval_batch)).sum();
  }
  mesh.get_group("dp")->all_reduce(correct)->wait();
  if (reports)
    std::cout << "test accuracy " << correct.item<double>() / test.images().size(0) << " ("
              << correct.item<int64_t>() << "/" << test.images().size(0) << ")" << std::endl;
  dtrain::destroy_process_group();
}
