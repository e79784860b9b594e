// dtrain-fashion-mnist: data-parallel training of a convnet on Fashion-MNIST.
//
//   dtrain-run --standalone --nproc-per-node 2 dtrain-fashion-mnist --epochs 3
//
// Every rank trains on its shard of the 60 000 training images (DistributedSampler),
// gradients are averaged by DistributedDataParallel, and after each epoch every
// rank scores its shard of the 10 000 test images and the counts are summed
// with all_reduce. Rank 0 shows progress, writes metrics and a plot. Every
// rank writes its share of a distributed checkpoint (checkpoint.h), so that a
// killed run resumes exactly (--resume, or automatically when dtrain-run
// restarts the job), also at another number of ranks.

#include <CLI/CLI.hpp>
#include <dtrain/data/fashion_mnist.h>
#include <dtrain/dtrain.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <csignal>
#include <functional>
#include <iostream>

#include "checkpoint.h"
#include "model.h"
#include "report.h"

namespace {

struct Flags {
  int64_t epochs = 5;
  int64_t batch_size = 64;
  double lr = 1e-3;
  double lr_decay = 0.7;  // learning rate of epoch e: lr * lr_decay^e
  std::string backend = "auto";
  std::string device = "cpu";
  std::string checkpoint_dir = "checkpoints";
  std::string out_dir;  // empty: runs/<date-time> (a new one per run)
  bool resume = false;
  int64_t seed = 0;
  int threads = 1;
  int64_t checkpoint_every = 200;
  std::string data_dir = dtrain::FashionMNIST::kDefaultRoot;
  int64_t train_limit = 0, test_limit = 0;
  int64_t crash_at_step = -1, crash_in_checkpoint_at_step = -1;  // test hooks
};

Flags parse(int argc, char** argv) {
  CLI::App app{"Data-parallel training of a convnet on Fashion-MNIST (run it under dtrain-run)"};
  Flags f;
  app.add_option("--epochs", f.epochs, "Epochs to train")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch-size", f.batch_size, "Batch size per rank")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "Learning rate of the first epoch (Adam)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr-decay", f.lr_decay, "Factor applied to the learning rate after each epoch")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--backend", f.backend, "Process-group backend")->capture_default_str();
  app.add_option("--device", f.device, "Where the model trains: cpu, or cuda (with --backend nccl)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--checkpoint-dir", f.checkpoint_dir,
                 "The checkpoint: a directory every rank writes its share into (shared by all ranks)")
      ->capture_default_str();
  app.add_option("--checkpoint-every", f.checkpoint_every, "Also checkpoint every N steps (0: epochs only)")->capture_default_str();
  app.add_option("--out-dir", f.out_dir, "Where metrics.jsonl and training.png go (default: runs/<date-time>)");
  app.add_flag("--resume", f.resume,
               "Resume from the checkpoint, at any number of ranks (automatic after a dtrain-run restart)");
  app.add_option("--seed", f.seed, "Seed of the initial weights and the data order")->capture_default_str();
  app.add_option("--threads", f.threads, "Intra-op threads per rank")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--data-dir", f.data_dir, "Fashion-MNIST .gz files")->capture_default_str();
  app.add_option("--train-limit", f.train_limit, "Use only the first N training images (0: all)");
  app.add_option("--test-limit", f.test_limit, "Use only the first N test images (0: all)");
  app.add_option("--crash-at-step", f.crash_at_step, "Test hook: the last rank SIGKILLs itself at this step (first attempt only)");
  app.add_option("--crash-in-checkpoint-at-step", f.crash_in_checkpoint_at_step, "Test hook: rank 0 dies while writing the checkpoint of this step (first attempt only)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  return f;
}

// CRC-32 of every parameter's bytes: equal checksums, bitwise equal models.
uint32_t checksum(torch::nn::Module& m) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const auto& p : m.parameters()) {
    auto c = p.detach().cpu().contiguous();
    crc = crc32(crc, static_cast<const Bytef*>(c.data_ptr()), static_cast<uInt>(c.nbytes()));
  }
  return static_cast<uint32_t>(crc);
}

// Scores this rank's shard of the test set (indices rank, rank+world, ...);
// returns {correct, total} summed over all ranks.
// A small tensor reduced over ranks (SUM unless told), exchanged on the default group's
// control device (the GPU under nccl).
torch::Tensor reduce_over_ranks(const torch::Tensor& host, dtrain::ReduceOp op = dtrain::ReduceOp::SUM) {
  auto t = host.to(dtrain::default_group()->control_device());
  dtrain::all_reduce(t, dtrain::AllReduceOptions().op(op));
  return t.cpu();
}

std::pair<int64_t, int64_t> evaluate(ConvNet& model, const dtrain::FashionMNIST& test, int64_t limit,
                                     const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  const int64_t n = limit > 0 ? std::min<int64_t>(limit, test.images().size(0)) : test.images().size(0);
  auto shard = torch::arange(dtrain::get_rank(), n, dtrain::get_world_size());
  int64_t correct = 0;
  for (int64_t i = 0; i < shard.numel(); i += 1000) {
    auto idx = shard.narrow(0, i, std::min<int64_t>(1000, shard.numel() - i));
    auto pred = model->forward(test.images().index_select(0, idx).to(device)).argmax(1);
    correct += pred.eq(test.targets().index_select(0, idx).to(device)).sum().item<int64_t>();
  }
  model->train();
  auto counts = reduce_over_ranks(torch::tensor({correct, shard.numel()}, torch::kLong));
  return {counts[0].item<int64_t>(), counts[1].item<int64_t>()};
}

}  // namespace

// Resume: explicitly (--resume), or because dtrain-run restarted the job
// and a checkpoint exists. Every rank validates the checkpoint before any
// rank installs it; a failure on one rank stops all of them with its error.
// A checkpoint written by another number of ranks resumes mid-epoch too:
// the samples of the epoch not yet trained on are dealt out to the ranks
// there are now (DistributedSampler::set_global_position).
static TrainingState resume_if_asked(const Flags& f, int64_t train_size, ConvNet& model,
                                     torch::optim::Adam& opt) {
  auto group = dtrain::default_group();
  const int world = dtrain::get_world_size();
  const bool leader = dtrain::get_rank() == 0;
  TrainingState state;
  state.world_size = world;
  const auto& dir = f.checkpoint_dir;
  if (!f.resume && !(dtrain::restart_count() > 0 && any_rank_has_checkpoint(*group, dir))) return state;
  state = load_checkpoint(group, dir, *model, opt, train_size);
  if (leader) {
    std::cout << "resumed from " << dir << " at epoch " << state.epoch + 1 << ", sample "
              << state.samples_in_epoch << " of " << train_size << " (restart "
              << dtrain::restart_count() << ")" << std::endl;
    if (state.world_size != world)
      std::cout << "the checkpoint was written by " << state.world_size << " rank(s), now " << world
                << ": the epoch's remaining " << train_size - state.samples_in_epoch
                << " samples are shared out among " << world << std::endl;
  }
  state.world_size = world;
  return state;
}

// mkdir -p: every level of `path`; false (errno set) when one cannot be made.
static bool make_dirs(const std::string& path) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) return false;
    if (slash == std::string::npos) break;
  }
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

namespace {

// Joins the job; on GPUs, one per local rank (the nccl group picks the same
// one). Returns the device to train on.
torch::Device init_distributed(const Flags& f) {
  const int gpus = f.device == "cuda" ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (f.device == "cuda" && gpus == 0) throw std::runtime_error("--device cuda: no CUDA device is visible");
  const int local_rank = dtrain::local_rank();
  dtrain::init_process_group(dtrain::InitOptions().backend(f.backend).device_id(
      gpus > 0 ? local_rank % gpus : -1));
  torch::set_num_threads(f.threads);
  return gpus > 0 ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus))
                  : torch::Device(torch::kCPU);
}

// --out-dir, or runs/<date-time>; created by rank 0. Empty when it cannot be.
std::string make_out_dir(const Flags& f, bool leader) {
  std::string out_dir = f.out_dir;
  if (out_dir.empty()) {
    char stamp[32];
    std::time_t now = std::time(nullptr);
    std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", std::localtime(&now));
    mkdir("runs", 0755);
    out_dir = std::string("runs/") + stamp;
  }
  if (leader && !make_dirs(out_dir)) {
    std::cerr << "cannot create --out-dir " << out_dir << ": " << std::strerror(errno) << std::endl;
    return "";
  }
  return out_dir;
}

// What an epoch of training uses; main owns all of it.
struct Job {
  const Flags& f;
  int rank, world;
  bool leader, first_attempt;
  torch::Device device;
  int64_t train_size, steps_per_epoch;
  dtrain::DistributedSampler& sampler;
  torch::optim::Adam& opt;
  dtrain::DistributedDataParallel<ConvNetImpl>& ddp;
  Progress& progress;
  // Every rank writes its share and learns the outcome, so nobody runs
  // ahead of a checkpoint that may fail, and a failure stops all ranks at once.
  std::function<void(const TrainingState&)> checkpoint;
};

struct EpochSums {
  int64_t steps = 0;
  double loss = 0;
};

// One epoch's batches from where `state` stands; advances state.global_step.
template <typename Loader>
EpochSums train_epoch(Job& job, Loader& loader, TrainingState& state, int64_t epoch) {
  const Flags& f = job.f;
  job.sampler.set_epoch(epoch);
  // A function of the epoch alone, so a resumed run uses the same rate.
  static_cast<torch::optim::AdamOptions&>(job.opt.param_groups()[0].options())
      .lr(f.lr * std::pow(f.lr_decay, static_cast<double>(epoch)));
  job.sampler.set_global_position(static_cast<size_t>(state.samples_in_epoch));
  // Steps already done, as this world size counts them (for the display):
  // what is left of the epoch, counted back from its full length, so a
  // resumed epoch ends at steps_per_epoch whatever world size began it.
  const int64_t steps_left = (static_cast<int64_t>(job.sampler.num_samples()) + f.batch_size - 1) / f.batch_size;
  const int64_t first_step = std::max<int64_t>(0, job.steps_per_epoch - steps_left);
  job.progress.start_epoch(epoch, first_step);
  EpochSums sums;
  for (auto& batch : loader) {
    job.opt.zero_grad();
    const torch::Tensor loss = torch::nn::functional::cross_entropy(job.ddp.forward(batch.data.to(job.device)),
                                                     batch.target.to(job.device));
    loss.backward();
    {
      dtrain::TimelineSpan span("optimizer.step");  // DTRAIN_TIMELINE
      job.opt.step();
    }
    ++sums.steps, ++state.global_step;
    sums.loss += loss.item<double>();
    if (job.first_attempt && state.global_step == f.crash_at_step && job.rank == job.world - 1) raise(SIGKILL);
    if (job.leader) job.progress.update(first_step + sums.steps, sums.loss / sums.steps);
    // Exact with workers(0): what every rank's loop has consumed.
    const auto samples = static_cast<int64_t>(job.sampler.global_position());
    if (f.checkpoint_every > 0 && state.global_step % f.checkpoint_every == 0 && samples < job.train_size)
      job.checkpoint({epoch, samples, state.global_step, job.world});
  }
  if (job.leader) job.progress.finish_epoch();
  return sums;
}

void print_epoch(const EpochMetrics& r, int64_t epochs, int64_t correct, int64_t total) {
  std::printf("epoch %lld/%lld: train loss %.4f, test accuracy %.2f%% (%lld/%lld), %.0f samples/s, %.1f s\n",
              static_cast<long long>(r.epoch), static_cast<long long>(epochs), r.train_loss,
              100 * r.test_accuracy, static_cast<long long>(correct), static_cast<long long>(total),
              r.samples_per_s, r.seconds);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  try {
    const torch::Device device = init_distributed(f);
    const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
    const bool leader = rank == 0;

    dtrain::FashionMNIST train(f.data_dir, dtrain::FashionMNIST::Mode::kTrain,
                               dtrain::FashionMNISTOptions().normalize(true));
    dtrain::FashionMNIST test(f.data_dir, dtrain::FashionMNIST::Mode::kTest,
                              dtrain::FashionMNISTOptions().normalize(true));
    const int64_t train_size = f.train_limit > 0 ? std::min<int64_t>(f.train_limit, *train.size())
                                                 : static_cast<int64_t>(*train.size());
    auto sampler = dtrain::DistributedSampler(
        static_cast<size_t>(train_size), dtrain::DistributedSamplerOptions().seed(f.seed));
    auto loader = torch::data::make_data_loader(
        train.map(torch::data::transforms::Stack<>()), sampler,
        torch::data::DataLoaderOptions().batch_size(f.batch_size).workers(0));
    const int64_t steps_per_epoch =
        (static_cast<int64_t>(sampler.num_samples()) + f.batch_size - 1) / f.batch_size;

    torch::manual_seed(f.seed);
    ConvNet model;
    model->to(device);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(f.lr));
    const bool restarted = dtrain::restart_count() > 0;
    TrainingState state = resume_if_asked(f, train_size, model, opt);
    dtrain::DistributedDataParallel ddp(model.ptr());

    const std::string out_dir = make_out_dir(f, leader);
    if (out_dir.empty()) return 2;
    Metrics metrics(out_dir);
    Progress progress(leader && dtrain::console_is_terminal(), f.epochs, steps_per_epoch,
                      f.batch_size * world);
    const bool first_attempt = !f.resume && !restarted;
    Job job{f, rank, world, leader, first_attempt, device, train_size, steps_per_epoch, sampler, opt, ddp,
            progress, [&](const TrainingState& s) {
              CheckpointFaults faults;
              faults.die_while_writing = first_attempt && leader && s.global_step == f.crash_in_checkpoint_at_step;
              save_checkpoint(dtrain::default_group(), f.checkpoint_dir, *model, opt, s, faults);
            }};
    if (leader)
      std::cout << "training on " << train_size << " images, " << world << " rank(s), batch "
                << f.batch_size << " per rank, " << f.epochs << " epoch(s)" << std::endl;

    double last_accuracy = 0, last_rate = 0;
    for (int64_t epoch = state.epoch; epoch < f.epochs; ++epoch) {
      const auto start = std::chrono::steady_clock::now();
      const EpochSums sums = train_epoch(job, *loader, state, epoch);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      auto loss_stats = reduce_over_ranks(torch::tensor({sums.loss, static_cast<double>(sums.steps)}, torch::kDouble));
      auto [correct, total] = evaluate(model, test, f.test_limit, device);
      last_accuracy = static_cast<double>(correct) / static_cast<double>(total);
      last_rate = sums.steps * f.batch_size * world / seconds;
      state = {epoch + 1, 0, state.global_step, world};
      job.checkpoint(state);
      if (leader) {
        const double train_loss = loss_stats[0].item<double>() / std::max(1.0, loss_stats[1].item<double>());
        const EpochMetrics record{epoch + 1, train_loss, last_accuracy, last_rate, seconds};
        print_epoch(record, f.epochs, correct, total);
        metrics.add(record);
      }
    }
    if (leader) {
      const auto png = metrics.plot();
      std::printf("done: test accuracy %.2f%% after %lld epoch(s), %.0f samples/s on %d rank(s); "
                  "parameters crc32 %08x%s%s\n",
                  100 * last_accuracy, static_cast<long long>(f.epochs), last_rate, world,
                  checksum(*model), png.empty() ? "" : "; plot ", png.c_str());
    }
    dtrain::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "dtrain-fashion-mnist: " << e.what() << std::endl;
    dtrain::record_error(e);  // dtrain-run's failure summary shows it
    return 1;
  }
}
