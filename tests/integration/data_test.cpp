// DistributedSampler (PyTorch's torch.utils.data.DistributedSampler
// semantics, through libtorch's data loader) and the Fashion-MNIST dataset
// (Debian's dataset-fashion-mnist files, and damaged copies of them).

#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "common/paths.h"
#include "dtrain/data/fashion_mnist.h"
#include "dtrain/dtrain.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using ::testing::HasSubstr;

// --- DistributedSampler ------------------------------------------------------

// torch.utils.data.DistributedSampler.__iter__, transcribed line by line
// (materializing the padded list, unlike src/data/partition.cpp). Its
// permutation comes from ATen's randperm on a CPU generator seeded with
// seed + epoch, the generator and kernel torch.randperm(n, generator=g) uses;
// this checks the padding/cutting/striding arithmetic. Bit-for-bit equality
// with Python's output is not checked here (no Python torch in the tests).
std::vector<size_t> reference(size_t n, size_t replicas, size_t rank, bool shuffle, int64_t seed,
                              int64_t epoch, bool drop_last) {
  std::vector<size_t> indices(n);
  if (shuffle) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(uint64_t(seed) + uint64_t(epoch));
    auto perm = at::randperm(int64_t(n), g, at::TensorOptions().dtype(at::kLong));
    for (size_t i = 0; i < n; ++i) indices[i] = size_t(perm[int64_t(i)].item<int64_t>());
  } else {
    std::iota(indices.begin(), indices.end(), size_t(0));
  }
  const double nd = double(n), rd = double(replicas);
  const size_t num_samples = (drop_last && n % replicas != 0)
                                 ? size_t(std::max(0.0, std::ceil((nd - rd) / rd)))
                                 : size_t(std::ceil(nd / rd));
  const size_t total = num_samples * replicas;
  if (!drop_last) {
    const size_t pad = total - n;
    if (pad <= n) {
      indices.insert(indices.end(), indices.begin(), indices.begin() + long(pad));
    } else {  // (indices * ceil(pad / n))[:pad]
      std::vector<size_t> repeated;
      for (size_t k = 0; k < (pad + n - 1) / n; ++k)
        repeated.insert(repeated.end(), indices.begin(), indices.begin() + long(n));
      indices.insert(indices.end(), repeated.begin(), repeated.begin() + long(pad));
    }
  } else {
    indices.resize(total);
  }
  std::vector<size_t> mine;
  for (size_t i = rank; i < total; i += replicas) mine.push_back(indices[i]);
  return mine;
}

DistributedSampler make_sampler(size_t n, int world, int rank, bool drop_last = false,
                                bool shuffle = true, int64_t seed = 0) {
  return DistributedSampler(n, DistributedSamplerOptions()
                                   .num_replicas(world)
                                   .rank(rank)
                                   .drop_last(drop_last)
                                   .shuffle(shuffle)
                                   .seed(seed));
}

std::vector<size_t> drain(DistributedSampler& sampler, size_t batch) {
  std::vector<size_t> all;
  while (auto b = sampler.next(batch)) {
    EXPECT_LE(b->size(), batch);
    all.insert(all.end(), b->begin(), b->end());
  }
  return all;
}

TEST(DistributedSampler, MatchesReferenceImplementation) {
  for (size_t n : {1, 3, 10, 11, 100})
    for (int world = 1; world <= 4; ++world)
      for (int rank = 0; rank < world; ++rank)
        for (bool drop_last : {false, true})
          for (bool shuffle : {false, true})
            for (int64_t seed : {0, 7})
              for (int64_t epoch : {0, 1, 5}) {
                SCOPED_TRACE(::testing::Message() << "n=" << n << " world=" << world << " rank="
                                                  << rank << " drop_last=" << drop_last
                                                  << " shuffle=" << shuffle << " seed=" << seed
                                                  << " epoch=" << epoch);
                auto s = make_sampler(n, world, rank, drop_last, shuffle, seed);
                s.set_epoch(epoch);
                s.reset();
                const auto want = reference(n, world, rank, shuffle, seed, epoch, drop_last);
                ASSERT_EQ(s.indices(), want);
                EXPECT_EQ(s.num_samples(), want.size());
                EXPECT_EQ(drain(s, 3), want);
              }
}

TEST(DistributedSampler, SequentialOrderPadsFromTheStartOrCutsTheTail) {
  using V = std::vector<size_t>;
  const std::vector<V> padded{{0, 4, 8}, {1, 5, 9}, {2, 6, 0}, {3, 7, 1}};
  const std::vector<V> cut{{0, 4}, {1, 5}, {2, 6}, {3, 7}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(make_sampler(10, 4, r, false, false).indices(), padded[r]);
    EXPECT_EQ(make_sampler(10, 4, r, true, false).indices(), cut[r]);
    // More ranks than samples: the list repeats as often as needed.
    EXPECT_EQ(make_sampler(1, 4, r, false, false).indices(), V{0});
    EXPECT_EQ(make_sampler(1, 4, r, true, false).indices(), V{});
  }
}

TEST(DistributedSampler, RanksCoverTheDatasetOncePlusPadding) {
  for (size_t n : {10, 11, 100})
    for (int world = 1; world <= 4; ++world)
      for (bool drop_last : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " world=" << world
                                          << " drop_last=" << drop_last);
        const size_t per_rank = drop_last ? n / world : (n + world - 1) / world;
        std::map<size_t, int> seen;
        std::vector<size_t> full(per_rank * world);  // interleaved back: full[r + i*world]
        for (int r = 0; r < world; ++r) {
          auto s = make_sampler(n, world, r, drop_last);
          s.set_epoch(2);
          s.reset();
          const auto mine = s.indices();
          ASSERT_EQ(mine.size(), per_rank);
          EXPECT_EQ(s.total_size(), per_rank * world);
          for (size_t i = 0; i < mine.size(); ++i) {
            ++seen[mine[i]];
            full[r + i * world] = mine[i];
          }
        }
        for (const auto& [index, times] : seen) ASSERT_LT(index, n);
        if (drop_last) {
          EXPECT_EQ(seen.size(), per_rank * world);  // no duplicates, tail dropped
          for (const auto& [index, times] : seen) EXPECT_EQ(times, 1);
        } else {
          EXPECT_EQ(seen.size(), n);  // every sample, the first (total - n) twice
          const size_t pad = per_rank * world - n;
          for (size_t j = 0; j < n; ++j) EXPECT_EQ(seen[full[j]], j < pad ? 2 : 1);
          for (size_t j = n; j < full.size(); ++j) EXPECT_EQ(full[j], full[j - n]);
        }
      }
}

// The interleaved ranks form one permutation that depends on seed + epoch
// only: not on the rank, nor on the world size.
std::vector<size_t> global_order(size_t n, int world, int64_t seed, int64_t epoch) {
  const size_t per_rank = (n + world - 1) / world;
  std::vector<size_t> full(per_rank * world);
  for (int r = 0; r < world; ++r) {
    auto s = make_sampler(n, world, r, false, true, seed);
    s.set_epoch(epoch);
    s.reset();
    const auto mine = s.indices();
    for (size_t i = 0; i < mine.size(); ++i) full[r + i * world] = mine[i];
  }
  full.resize(n);
  return full;
}

TEST(DistributedSampler, SamePermutationOnEveryRankNewOneEachEpoch) {
  const auto e0 = global_order(100, 1, 0, 0);
  auto sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<size_t> identity(100);
  std::iota(identity.begin(), identity.end(), size_t(0));
  EXPECT_EQ(sorted, identity);
  EXPECT_NE(e0, identity);
  for (int world = 2; world <= 4; ++world) EXPECT_EQ(global_order(100, world, 0, 0), e0);
  EXPECT_NE(global_order(100, 3, 0, 1), e0);
  EXPECT_NE(global_order(100, 3, 1, 0), e0);
  EXPECT_EQ(global_order(100, 3, 1, 0), global_order(100, 2, 0, 1));  // seed + epoch
}

TEST(DistributedSampler, RejectsBadArguments) {
  auto message = [](auto&& make) {
    try {
      make();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no InvalidArgument");
  };
  EXPECT_THAT(message([] { make_sampler(10, 0, 0); }),
              HasSubstr("num_replicas must be at least 1, got 0"));
  EXPECT_THAT(message([] { make_sampler(10, 4, 4); }), HasSubstr("rank 4 is outside [0, 4)"));
  EXPECT_THAT(message([] { make_sampler(10, 4, -1); }), HasSubstr("rank -1 is outside [0, 4)"));
  EXPECT_THAT(message([] { make_sampler(0, 2, 0); }),
              HasSubstr("dataset_size must be positive, got 0"));
  ASSERT_FALSE(is_initialized());
  EXPECT_THAT(message([] { DistributedSampler s(10); }), HasSubstr("init_process_group"));
  EXPECT_THAT(message([] {
                auto s = make_sampler(10, 2, 0);
                s.set_position(6);
              }),
              HasSubstr("position 6 is past the end of the epoch (num_samples 5)"));
}

TEST(DistributedSampler, TakesRankAndWorldFromTheGroup) {
  init_process_group(InitOptions().store(std::make_shared<HashStore>()).rank(0).world_size(1));
  DistributedSampler from_default(10);
  EXPECT_EQ(from_default.rank(), 0);
  EXPECT_EQ(from_default.num_replicas(), 1);
  destroy_process_group();

  std::vector<std::vector<size_t>> per_rank(3);
  auto errors = testing::run_rank_contexts(3, [&](testing::RankContext& ctx) {
    DistributedSampler s(11, DistributedSamplerOptions().process_group(ctx.group));
    EXPECT_EQ(s.rank(), ctx.rank);
    EXPECT_EQ(s.num_replicas(), 3);
    per_rank[ctx.rank] = s.indices();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  for (int r = 0; r < 3; ++r) EXPECT_EQ(per_rank[r], reference(11, 3, r, true, 0, 0, false));
}

// A dataset whose sample i is the index i: what a loader yields is the order.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  explicit IndexDataset(size_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override {
    return {torch::tensor(int64_t(i)), torch::tensor(int64_t(0))};
  }
  torch::optional<size_t> size() const override { return n; }
  size_t n;
};

template <typename Loader>
std::vector<size_t> one_epoch(Loader& loader) {
  std::vector<size_t> got;
  for (auto& batch : loader)
    for (auto& example : batch) got.push_back(size_t(example.data.template item<int64_t>()));
  return got;
}

TEST(DistributedSampler, DrivesLibtorchDataLoaderWithWorkerThreads) {
  const size_t n = 103;
  for (int world : {1, 3}) {
    std::map<size_t, int> seen;
    for (int r = 0; r < world; ++r) {
      auto sampler = make_sampler(n, world, r);
      auto loader = torch::data::make_data_loader(
          IndexDataset(n), sampler, torch::data::DataLoaderOptions().batch_size(4).workers(2));
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        sampler.set_epoch(epoch);  // reaches the loader's copy: copies share state
        const auto got = one_epoch(*loader);
        EXPECT_EQ(got, reference(n, world, r, true, 0, epoch, false)) << "epoch " << epoch;
        if (epoch == 0)
          for (size_t i : got) ++seen[i];
      }
    }
    EXPECT_EQ(seen.size(), n);
  }
}

TEST(DistributedSampler, WarnsOnceWhenAnEpochRepeatsWithoutSetEpoch) {
  auto sampler = make_sampler(20, 2, 0);
  auto loader = torch::data::make_data_loader(
      IndexDataset(20), sampler, torch::data::DataLoaderOptions().batch_size(4).workers(2));
  ::testing::internal::CaptureStderr();
  const auto first = one_epoch(*loader);  // epoch 0: first start, no warning
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");

  ::testing::internal::CaptureStderr();
  EXPECT_EQ(one_epoch(*loader), first);  // forgot set_epoch: same order
  one_epoch(*loader);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("[dtrain] warning: DistributedSampler: epoch 0 started again"));
  EXPECT_THAT(err, HasSubstr("set_epoch"));
  EXPECT_EQ(err.find("warning"), err.rfind("warning")) << "warned more than once:\n" << err;

  // Calling set_epoch, or not shuffling, is silent.
  for (bool shuffle : {true, false}) {
    auto s = make_sampler(20, 2, 0, false, shuffle);
    ::testing::internal::CaptureStderr();
    for (int64_t e = 0; e < 3; ++e) {
      if (shuffle) s.set_epoch(e);
      s.reset();
    }
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << "shuffle " << shuffle;
  }
}

TEST(DistributedSampler, ResumesMidEpochExactly) {
  const size_t n = 50;
  const auto order = reference(n, 2, 1, true, 0, 3, false);  // 25 indices
  auto full = make_sampler(n, 2, 1);
  full.set_epoch(3);
  // With workers(0), position() counts the batches up to the one the loop
  // body holds: here the third.
  auto sync_loader = torch::data::make_data_loader(
      IndexDataset(n), full, torch::data::DataLoaderOptions().batch_size(4));
  auto it = sync_loader->begin();
  EXPECT_EQ((*it)[0].data.item<int64_t>(), int64_t(order[0]));
  ++it;
  ++it;
  EXPECT_EQ((*it)[0].data.item<int64_t>(), int64_t(order[8]));
  EXPECT_EQ(full.position(), 12u);

  const std::vector<size_t> rest(order.begin() + 12, order.end());
  for (size_t workers : {0, 2}) {
    auto resumed = make_sampler(n, 2, 1);  // a fresh process after restart
    resumed.set_epoch(3);
    resumed.set_position(12);
    auto loader = torch::data::make_data_loader(
        IndexDataset(n), resumed, torch::data::DataLoaderOptions().batch_size(4).workers(workers));
    EXPECT_EQ(one_epoch(*loader), rest) << workers << " workers";
    resumed.set_epoch(4);  // the next epoch starts at 0 again
    EXPECT_EQ(one_epoch(*loader), reference(n, 2, 1, true, 0, 4, false));
  }

  // Through save/load (e.g. inside a checkpoint).
  std::ostringstream bytes;
  {
    torch::serialize::OutputArchive out;
    full.save(out);
    out.save_to(bytes);
  }
  auto load = [&](DistributedSampler s) {
    std::istringstream in_bytes(bytes.str());
    torch::serialize::InputArchive in;
    in.load_from(in_bytes);
    s.load(in);
    return s;
  };
  auto restored = load(make_sampler(n, 2, 0));  // another rank may load rank 1's archive
  EXPECT_EQ(restored.epoch(), 3);
  EXPECT_EQ(restored.position(), 12u);
  const auto rank0 = reference(n, 2, 0, true, 0, 3, false);
  EXPECT_EQ(drain(restored, 5), std::vector<size_t>(rank0.begin() + 12, rank0.end()));
  try {
    load(make_sampler(n, 3, 0));
    ADD_FAILURE() << "loading a 2-replica archive into a 3-replica sampler did not throw";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("num_replicas 2 but this sampler has num_replicas 3"));
  }
}

// A job of 2 ranks trains 7 batches of one each into epoch 3, and resumes at
// another world size from the global position: the remaining samples are
// dealt to the new ranks, each seen once (plus padding when the new world
// size does not divide them), and the next epoch is a full one again.
TEST(DistributedSampler, ResumesAtAnotherWorldSizeFromTheGlobalPosition) {
  const size_t n = 50;
  std::multiset<size_t> seen;
  for (int r = 0; r < 2; ++r) {
    auto s = make_sampler(n, 2, r);
    s.set_epoch(3);
    s.reset();
    for (int b = 0; b < 7; ++b) {
      auto batch = s.next(1);
      ASSERT_TRUE(batch.has_value());
      seen.insert(batch->begin(), batch->end());
    }
    EXPECT_EQ(s.global_position(), 14u);
  }
  for (int world : {1, 3, 4, 7}) {
    std::multiset<size_t> all = seen;
    size_t per_rank = 0;
    for (int r = 0; r < world; ++r) {
      auto s = make_sampler(n, world, r);
      s.set_epoch(3);
      s.set_global_position(14);
      per_rank = s.num_samples();
      auto loader = torch::data::make_data_loader(IndexDataset(n), s,
                                                  torch::data::DataLoaderOptions().batch_size(4));
      const auto mine = one_epoch(*loader);  // the loader's reset keeps the skip
      EXPECT_EQ(mine.size(), per_rank);
      all.insert(mine.begin(), mine.end());
      EXPECT_EQ(s.global_position(), std::min<size_t>(n, 14 + per_rank * size_t(world)));
      s.set_epoch(4);  // the next epoch is whole again
      EXPECT_EQ(one_epoch(*loader), reference(n, size_t(world), size_t(r), true, 0, 4, false));
    }
    EXPECT_EQ(per_rank, (36 + size_t(world) - 1) / size_t(world)) << world << " ranks";
    const size_t padding = per_rank * size_t(world) - 36;
    EXPECT_EQ(all.size(), n + padding) << world << " ranks";
    for (size_t i = 0; i < n; ++i) EXPECT_GE(all.count(i), 1u) << "sample " << i << ", " << world << " ranks";
  }

  // At the same world size the global position is the per-rank one.
  for (int r = 0; r < 2; ++r) {
    auto s = make_sampler(n, 2, r);
    s.set_epoch(3);
    s.set_global_position(14);
    const auto full = reference(n, 2, size_t(r), true, 0, 3, false);
    EXPECT_EQ(drain(s, 3), std::vector<size_t>(full.begin() + 7, full.end()));
  }
  // drop_last cuts the remaining samples to a multiple of the world size.
  auto cut = make_sampler(n, 4, 1, /*drop_last=*/true);
  cut.set_global_position(14);
  EXPECT_EQ(cut.num_samples(), 9u);
  auto empty = make_sampler(n, 3, 0);
  empty.set_global_position(n);
  EXPECT_EQ(empty.num_samples(), 0u);
  EXPECT_FALSE(empty.next(4).has_value());
  try {
    make_sampler(n, 3, 0).set_global_position(51);
    ADD_FAILURE() << "a global position past the dataset did not throw";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("set_global_position: 51 samples is past the end of the epoch "
                                    "(dataset_size 50)"));
  }
}

// --- FashionMNIST ---------------------------------------------------------------

const std::string kRoot = FashionMNIST::kDefaultRoot;

TEST(FashionMNIST, LoadsDebianFiles) {
  const auto start = std::chrono::steady_clock::now();
  FashionMNIST train(kRoot, FashionMNIST::Mode::kTrain);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "loaded the training set in " << seconds << " s\n";
  FashionMNIST test(kRoot, FashionMNIST::Mode::kTest);
  ASSERT_EQ(train.size().value(), 60000u);
  ASSERT_EQ(test.size().value(), 10000u);

  for (auto* set : {&train, &test}) {
    const auto& x = set->images();
    EXPECT_EQ(x.sizes(), (std::vector<int64_t>{int64_t(set->size().value()), 1, 28, 28}));
    EXPECT_EQ(x.scalar_type(), torch::kFloat);
    EXPECT_EQ(x.min().item<float>(), 0.0f);
    EXPECT_EQ(x.max().item<float>(), 1.0f);
    EXPECT_EQ(set->targets().scalar_type(), torch::kLong);
    // Balanced classes: 6000 per class in train, 1000 in test.
    const auto per_class = int64_t(set->size().value() / 10);
    EXPECT_TRUE(torch::equal(torch::bincount(set->targets()),
                             torch::full({10}, per_class, torch::kLong)));
  }
  // Facts from the files (read independently with Python's gzip module).
  auto first_labels = [](FashionMNIST& d) {
    std::vector<int64_t> v;
    for (size_t i = 0; i < 10; ++i) v.push_back(d.get(i).target.item<int64_t>());
    return v;
  };
  EXPECT_EQ(first_labels(train), (std::vector<int64_t>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5}));
  EXPECT_EQ(first_labels(test), (std::vector<int64_t>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7}));
  EXPECT_EQ(std::lround(train.get(0).data.sum().item<double>() * 255), 76247);
  EXPECT_EQ(std::lround(test.get(0).data.sum().item<double>() * 255), 33456);
  EXPECT_NEAR(train.images().mean().item<double>(), 0.2860406, 1e-5);
  EXPECT_EQ(train.get(59999).data.sizes(), (std::vector<int64_t>{1, 28, 28}));
  EXPECT_THROW(train.get(60000), InvalidArgument);

  FashionMNIST normalized(kRoot, FashionMNIST::Mode::kTrain,
                          FashionMNISTOptions().normalize(true));
  EXPECT_NEAR(normalized.images().mean().item<double>(), 0.0, 1e-3);
  EXPECT_NEAR(normalized.images().std().item<double>(), 1.0, 1e-2);
}

// The pipeline docs/data.md shows: stacked batches of this rank's share.
TEST(FashionMNIST, FeedsADataLoaderThroughTheSampler) {
  FashionMNIST test(kRoot, FashionMNIST::Mode::kTest);
  auto sampler = DistributedSampler(test.size().value(),
                                    DistributedSamplerOptions().num_replicas(3).rank(2));
  auto loader = torch::data::make_data_loader(
      test.map(torch::data::transforms::Stack<>()), sampler,
      torch::data::DataLoaderOptions().batch_size(256).workers(2));
  sampler.set_epoch(1);
  int64_t samples = 0, batches = 0;
  std::vector<int64_t> labels;
  for (auto& batch : *loader) {
    EXPECT_EQ(batch.data.sizes().slice(1), (std::vector<int64_t>{1, 28, 28}));
    samples += batch.data.size(0);
    ++batches;
    for (int64_t i = 0; i < batch.target.size(0); ++i)
      labels.push_back(batch.target[i].item<int64_t>());
  }
  EXPECT_EQ(samples, 3334);  // ceil(10000 / 3)
  EXPECT_EQ(batches, 14);
  const auto order = sampler.indices();
  ASSERT_EQ(labels.size(), order.size());
  for (size_t i = 0; i < order.size(); ++i)
    ASSERT_EQ(labels[i], test.targets()[int64_t(order[i])].item<int64_t>()) << i;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), unsigned(bytes.size())), int(bytes.size()));
  gzclose(f);
}

std::string be32(uint32_t v) {
  return {char(v >> 24), char((v >> 16) & 0xff), char((v >> 8) & 0xff), char(v & 0xff)};
}

// A temporary copy of the test split in which one file is then replaced.
class DamagedFashionMNIST : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = paths::make_temp_dir("dtrain_fmnist_");
    for (const char* f : {"t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"})
      paths::copy_file(paths::join(kRoot, f), paths::join(dir_, f));
  }
  void TearDown() override { paths::remove_all(dir_); }
  std::string labels() const { return paths::join(dir_, "t10k-labels-idx1-ubyte.gz"); }
  std::string images() const { return paths::join(dir_, "t10k-images-idx3-ubyte.gz"); }
  std::string error() const {
    try {
      FashionMNIST(dir_, FashionMNIST::Mode::kTest);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "no InvalidArgument";
  }
  std::string dir_;
};

TEST_F(DamagedFashionMNIST, IntactCopyLoads) { EXPECT_EQ(error(), "no InvalidArgument"); }

TEST_F(DamagedFashionMNIST, WrongMagic) {
  write_gz(labels(), be32(1234) + be32(10000) + std::string(10000, '\1'));
  EXPECT_EQ(error(), labels() + ": expected magic 2049 (IDX labels), found 1234");
}

TEST_F(DamagedFashionMNIST, TooFewLabels) {
  write_gz(labels(), be32(2049) + be32(10000) + std::string(1000, '\1'));
  EXPECT_EQ(error(), labels() + ": file ends after 1000 of 10000 labels");
}

TEST_F(DamagedFashionMNIST, WrongCountDimensionsOrLabel) {
  write_gz(labels(), be32(2049) + be32(9999) + std::string(9999, '\1'));
  EXPECT_EQ(error(), labels() + ": expected 10000 labels, the header says 9999");
  write_gz(labels(), be32(2049) + be32(10000) + std::string(5, '\1') + '\x0c' +
                         std::string(9994, '\1'));
  EXPECT_EQ(error(), labels() + ": label 12 at index 5 is outside 0..9");
  write_gz(labels(), be32(2049) + be32(10000) + std::string(10001, '\1'));
  EXPECT_EQ(error(), labels() + ": unexpected data after the 10000 labels");
  write_gz(labels(), be32(2049) + be32(10000) + std::string(10000, '\1'));
  write_gz(images(), be32(2051) + be32(10000) + be32(32) + be32(32));
  EXPECT_EQ(error(), images() + ": expected images of 28x28, found 32x32");
}

TEST_F(DamagedFashionMNIST, TruncatedGzipStream) {
  const std::string whole = read_bytes(images());
  write_bytes(images(), whole.substr(0, whole.size() / 2));
  const std::string e = error();
  EXPECT_THAT(e, HasSubstr(images() + ": file ends after "));
  EXPECT_THAT(e, HasSubstr(" of 10000 images (gzip stream truncated)"));
}

TEST_F(DamagedFashionMNIST, CorruptChecksum) {
  std::string whole = read_bytes(labels());
  whole[whole.size() - 8] ^= 0x5a;  // the gzip trailer's CRC-32
  write_bytes(labels(), whole);
  EXPECT_THAT(error(), HasSubstr(labels() + ": corrupt gzip data ("));
}

TEST_F(DamagedFashionMNIST, MissingFileOrDirectory) {
  paths::remove_all(labels());
  EXPECT_EQ(error(), labels() + ": no such file");
  const std::string missing = paths::join(dir_, "nowhere");
  try {
    FashionMNIST(missing, FashionMNIST::Mode::kTrain);
    ADD_FAILURE() << "no error for a missing directory";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("dataset directory '" + missing + "' does not exist"));
  }
}

}  // namespace
}  // namespace dtrain
