// export_safetensors and import_safetensors: a model's state_dict written
// whole and read back by a reader written here from the published format
// (nlohmann's JSON; no code shared with the writer); files split by
// max_shard_bytes with Hugging Face's names and index; the Llama example's
// model exported from PP 2 x FSDP 2 equal to one process's parameters and
// imported into one process, FSDP and DDP layouts bitwise; a damaged file,
// a dtype or shape that differs and a missing tensor named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "checkpoint/storage/safetensors/export_seam.h"
#include "checkpoint/storage/safetensors/reader.h"
#include "common/paths.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/expert_parallel.h"
#include "dtrain/fsdp.h"
#include "dtrain/tensor_parallel.h"
#include "harness/assertions.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"
#include "model.h"

namespace dtrain {
namespace {

namespace ckpt = checkpoint;
using namespace std::chrono_literals;
using Tensors = std::map<std::string, at::Tensor>;
using testing::RankContext;

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The published format, read here independently of dtrain's reader.
Tensors read_by_the_spec(const std::string& path, std::map<std::string, std::string>* metadata = nullptr) {
  const std::string file = bytes_of(path);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<unsigned char>(file[static_cast<size_t>(k)]);
  const auto header = nlohmann::json::parse(file.substr(8, n));
  const std::map<std::string, at::ScalarType> types = {
      {"F32", at::kFloat}, {"F64", at::kDouble}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
      {"I64", at::kLong},  {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},   {"BOOL", at::kBool}};
  Tensors out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (metadata)
        for (const auto& [k, v] : info.items()) (*metadata)[k] = v.get<std::string>();
      continue;
    }
    const auto shape = info.at("shape").get<std::vector<int64_t>>();
    const auto offsets = info.at("data_offsets").get<std::vector<uint64_t>>();
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(types.at(info.at("dtype").get<std::string>())));
    EXPECT_EQ(offsets[1] - offsets[0], t.nbytes()) << name;
    std::memcpy(t.data_ptr(), file.data() + 8 + n + offsets[0], t.nbytes());
    out[name] = t;
  }
  return out;
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    register_module("embed", torch::nn::Embedding(10, 4));
    register_module("fc", torch::nn::Linear(4, 3));
    register_module("bn", torch::nn::BatchNorm1d(3));
    register_buffer("table", at::arange(6, at::kLong).reshape({2, 3}));
    register_parameter("half", at::randn({5}).to(at::kBFloat16));
  }
};
TORCH_MODULE(Net);

Tensors state_dict_of(torch::nn::Module& m) {
  Tensors out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  for (const auto& item : m.named_buffers()) out[item.key()] = item.value().detach().clone();
  return out;
}

void expect_equal(const Tensors& got, const Tensors& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, value] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": no " << name;
    EXPECT_TRUE(at::equal(got.at(name), value)) << what << ": " << name;
  }
}

// `body` on one thread rank (a group of one).
void one_rank(const std::function<void(const std::shared_ptr<ProcessGroup>&)>& body) {
  testing::expect_no_errors(testing::run_rank_contexts(1, [&](RankContext& ctx) { body(ctx.group); }));
}

TEST(Safetensors, AStateDictGoesOutWholeAndComesBackBitwise) {
  testing::TempDir dir;
  torch::manual_seed(1);
  Net net;
  net->named_buffers()["bn.running_mean"].copy_(at::randn({3}));
  one_rank([&](const auto& group) {
    ckpt::DistributedState state;
    ckpt::add_module(state, *net);
    state.metadata["step"] = "7";
    ckpt::export_safetensors(dir.path() + "/hf", state, ckpt::SafetensorsOptions().process_group(group));
  });
  EXPECT_FALSE(paths::exists(dir.path() + "/hf/.dtrain-export")) << "the staging checkpoint is removed";
  std::map<std::string, std::string> metadata;
  expect_equal(read_by_the_spec(dir.path() + "/hf/model.safetensors", &metadata), state_dict_of(*net),
               "read by the spec");
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"format", "pt"}, {"step", "7"}}));
  torch::manual_seed(2);
  Net other;
  ckpt::DistributedState into;
  ckpt::add_module(into, *other);
  ckpt::import_safetensors(dir.path() + "/hf", into);
  expect_equal(state_dict_of(*other), state_dict_of(*net), "imported");
}

TEST(Safetensors, FilesSplitAtMaxShardBytesWithTheIndexAndALaterExportReplacesThem) {
  testing::TempDir dir;
  Net net;
  const std::string out = dir.path() + "/hf";
  auto export_with = [&](int64_t max_bytes) {
    one_rank([&](const auto& group) {
      ckpt::DistributedState state;
      ckpt::add_module(state, *net);
      ckpt::export_safetensors(out, state, ckpt::SafetensorsOptions().process_group(group).max_shard_bytes(max_bytes));
    });
  };
  export_with(64);  // embed.weight alone is 160 bytes: a file of its own
  std::vector<std::string> files;
  for (const auto& f : paths::list(out)) files.push_back(f);
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 4u);
  EXPECT_EQ(files.front(), "model-00001-of-0000" + std::to_string(files.size() - 1) + ".safetensors");
  EXPECT_EQ(files.back(), "model.safetensors.index.json");
  const auto index = nlohmann::json::parse(bytes_of(out + "/model.safetensors.index.json"));
  Tensors all;
  for (const auto& [name, file] : index.at("weight_map").items()) {
    const auto in_file = read_by_the_spec(out + "/" + file.get<std::string>());
    ASSERT_TRUE(in_file.count(name)) << name << " in " << file;
    all[name] = in_file.at(name);
  }
  expect_equal(all, state_dict_of(*net), "through the index");
  export_with(int64_t{1} << 30);
  EXPECT_EQ(paths::list(out), std::vector<std::string>{"model.safetensors"}) << "the earlier shards are removed";
}

// The Llama example's model: PP 2 x FSDP 2 (4 thread ranks, TP groups of
// one) exports its parameters; they equal one process's, and import into
// one process, into the FSDP layout and into DDP stages bitwise.
TEST(Safetensors, TheLlamaModelFromPipelineTimesFsdpEqualsOneProcessAndImportsIntoEveryLayout) {
  testing::TempDir dir;
  const std::string out = dir.path() + "/hf";
  llama::Config c;
  c.vocab = 32, c.dim = 16, c.layers = 2, c.heads = 2, c.hidden = 24, c.seq = 8;
  auto stage_of = [&](const std::shared_ptr<ProcessGroup>& tp, int s, uint64_t seed) {
    return llama::Stage(c, llama::Layout::over(tp), llama::initial_values(c, seed, s, s + 1, s == 0, s == 1),
                        s, s + 1, s == 0, s == 1);
  };
  auto on_mesh = [&](const std::function<void(RankContext&, DeviceMesh&, int)>& body) {
    testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
      DeviceMesh mesh({2, 2, 1}, {"pp", "dp", "tp"}, testing::thread_mesh(ctx));
      body(ctx, mesh, mesh.get_local_rank("pp"));
    }));
  };
  on_mesh([&](RankContext& ctx, DeviceMesh& mesh, int s) {
    auto stage = stage_of(mesh.get_group("tp"), s, 3);
    FullyShardedDataParallel<llama::StageImpl> fsdp(stage.ptr(), FSDPOptions().process_group(mesh.get_group("dp")));
    ckpt::DistributedState state;
    ckpt::add_fsdp_parameters(state, fsdp);
    ckpt::export_safetensors(out, state, ckpt::SafetensorsOptions().process_group(ctx.group));
  });
  Tensors whole;
  one_rank([&](const auto& group) {
    llama::Stage one(c, llama::Layout::over(group), llama::initial_values(c, 3, 0, 2, true, true), 0, 2,
                     true, true);
    whole = state_dict_of(*one);
    expect_equal(read_by_the_spec(out + "/model.safetensors"), whole, "PP 2 x FSDP 2's export");
    llama::Stage fresh(c, llama::Layout::over(group), llama::initial_values(c, 9, 0, 2, true, true), 0, 2,
                       true, true);
    ckpt::DistributedState into;
    ckpt::add_module(into, *fresh);
    ckpt::import_safetensors(out, into);
    expect_equal(state_dict_of(*fresh), whole, "imported into one process");
  });
  std::mutex mu;
  on_mesh([&](RankContext&, DeviceMesh& mesh, int s) {
    auto sharded = stage_of(mesh.get_group("tp"), s, 9);
    FullyShardedDataParallel<llama::StageImpl> fsdp(sharded.ptr(), FSDPOptions().process_group(mesh.get_group("dp")));
    ckpt::DistributedState state;
    ckpt::add_fsdp_parameters(state, fsdp);
    ckpt::import_safetensors(out, state);
    auto replicated = stage_of(mesh.get_group("tp"), s, 9);
    DistributedDataParallel<llama::StageImpl> ddp(replicated.ptr(), DDPOptions().process_group(mesh.get_group("dp")));
    ckpt::DistributedState plain;
    ckpt::add_module(plain, *replicated);
    ckpt::import_safetensors(out, plain);
    const auto fsdp_values = fsdp.full_state_dict(), ddp_values = state_dict_of(*replicated);
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [name, value] : fsdp_values)
      EXPECT_TRUE(at::equal(value, whole.at(name))) << "FSDP stage " << s << ": " << name;
    for (const auto& [name, value] : ddp_values)
      EXPECT_TRUE(at::equal(value, whole.at(name))) << "DDP stage " << s << ": " << name;
  });
}

// FSDP's parameters by name (add_fsdp_parameters), the state built once and
// exported twice, the weights changed in place between the exports as an
// optimizer's step changes them: the second export holds the new values.
// Before, the state gathered the shards once, when built, and export ran
// none of its before_save hooks: both exports held the first values.
TEST(Safetensors, AnFsdpStateBuiltOnceExportsTheValuesOfEachExport) {
  testing::TempDir dir;
  const std::string out = dir.path() + "/hf";
  std::mutex mu;
  Tensors live;
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
    torch::nn::Linear linear(6, 5);
    FullyShardedDataParallel<torch::nn::LinearImpl> fsdp(linear.ptr(), FSDPOptions().process_group(ctx.group));
    ckpt::DistributedState state;
    ckpt::add_fsdp_parameters(state, fsdp);
    const auto options = ckpt::SafetensorsOptions().process_group(ctx.group);
    ckpt::export_safetensors(out, state, options);
    {
      at::NoGradGuard no_grad;
      for (auto& p : fsdp.parameters()) p.mul_(2).add_(1);
    }
    ckpt::export_safetensors(out, state, options);
    auto values = fsdp.full_state_dict();
    std::lock_guard<std::mutex> lock(mu);
    if (ctx.rank == 0) live = values;
  }));
  const Tensors exported = read_by_the_spec(out + "/model.safetensors");
  ASSERT_EQ(exported.size(), 2u);
  for (const auto& [name, value] : live) {
    ASSERT_TRUE(exported.count(name)) << name;
    EXPECT_TRUE(at::equal(exported.at(name), value)) << name << " as of the second export";
  }
}

// Rank 0 of a 3-file export stops before its second file (the seam: what a
// crash there leaves). The directory still holds the earlier export as its
// index names it, and import_safetensors, which reads every file, names a
// tensor that two files hold. The next export goes through and leaves no
// other file. Before, files were replaced one by one under their fixed
// names: the earlier index named the new first file beside old others,
// one silently mixed model.
TEST(Safetensors, AnExportInterruptedAfterItsFirstFileLeavesTheEarlierOneAsItsIndexNamesIt) {
  testing::TempDir dir;
  Net net;
  const std::string out = dir.path() + "/hf";
  auto export_now = [&] {
    std::string error;
    one_rank([&](const auto& group) {
      ckpt::DistributedState state;
      ckpt::add_module(state, *net);
      try {
        ckpt::export_safetensors(out, state, ckpt::SafetensorsOptions().process_group(group).max_shard_bytes(64));
      } catch (const Error& e) {
        error = e.what();
      }
    });
    return error;
  };
  auto through_the_index = [&] {
    const auto index = nlohmann::json::parse(bytes_of(out + "/model.safetensors.index.json"));
    Tensors all;
    for (const auto& [name, file] : index.at("weight_map").items())
      all[name] = read_by_the_spec(out + "/" + file.get<std::string>()).at(name);
    return all;
  };
  EXPECT_EQ(export_now(), "");
  const Tensors first = state_dict_of(*net);
  const size_t files = paths::list(out).size();
  ASSERT_GE(files, 4u) << "three files or more, and the index";
  {
    at::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.add_(1);
    for (auto& b : net->buffers()) b.add_(1);
  }
  ckpt::detail::stop_export_after_files(1);
  EXPECT_EQ(export_now(), "export_safetensors " + out +
                              ": rank 0: export_safetensors: stopped after 1 files (the test seam)");
  ckpt::detail::stop_export_after_files(-1);
  expect_equal(through_the_index(), first, "the earlier export, through its index");
  Net other;
  ckpt::DistributedState into;
  ckpt::add_module(into, *other);
  const auto refused = testing::what_thrown<InvalidArgument>([&] { ckpt::import_safetensors(out, into); });
  EXPECT_NE(refused.find("' is in both "), std::string::npos) << refused;
  EXPECT_NE(refused.find("(files of two exports: was one interrupted? export again)"), std::string::npos) << refused;
  EXPECT_EQ(export_now(), "");
  expect_equal(through_the_index(), state_dict_of(*net), "the next export, through its index");
  EXPECT_EQ(paths::list(out).size(), files) << "the interrupted export's file is gone";
}

// The others wait for rank 0's conversion under a group timeout shorter
// than it (one file, written after 1 s; a 250 ms timeout): rank 0's word
// every quarter of the timeout keeps them waiting. Before, they waited in a
// collective, and the export failed with a timeout on every rank.
TEST(Safetensors, AnExportOutlastsAGroupTimeoutShorterThanItsConversion) {
  testing::TempDir dir;
  const std::string out = dir.path() + "/hf";
  ckpt::detail::slow_export_files(std::chrono::seconds(1));
  const auto errors = testing::run_rank_contexts(2, [&](RankContext& ctx) {
    Net net;
    ckpt::DistributedState state;
    if (ctx.rank == 0) ckpt::add_module(state, *net);
    ckpt::export_safetensors(out, state, ckpt::SafetensorsOptions().process_group(ctx.group));
  }, std::chrono::milliseconds(250));
  ckpt::detail::slow_export_files(std::chrono::milliseconds(0));
  testing::expect_no_errors(errors);
  EXPECT_TRUE(paths::exists(out + "/model.safetensors"));
}

// Tensor parallelism: 4 ranks import a whole layer's weights into a
// RowParallelLinear, each reading only its box of the file (its 8 columns
// of each row of the weight) and the whole bias, which every rank holds.
// Before, each rank read every tensor whole (4 times the file's weight
// between them) and kept it alive through the narrowed view until the end.
TEST(Safetensors, EachTensorParallelRankReadsOnlyItsBoxOfTheFile) {
  testing::TempDir dir;
  const std::string out = dir.path() + "/hf";
  torch::manual_seed(5);
  torch::nn::Linear whole(32, 16);
  one_rank([&](const auto& group) {
    ckpt::DistributedState state;
    ckpt::add_module(state, *whole);
    ckpt::export_safetensors(out, state, ckpt::SafetensorsOptions().process_group(group));
  });
  const uint64_t before = ckpt::detail::safetensors_bytes_read();
  std::vector<Tensors> got(4);
  testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
    tensor_parallel::RowParallelLinear layer(32, 16, tensor_parallel::ParallelLinearOptions().group(ctx.group));
    ckpt::DistributedState state;
    ckpt::add_module(state, *layer);
    ckpt::import_safetensors(out, state);
    got[ctx.rank] = state_dict_of(*layer);
  }));
  const uint64_t read = ckpt::detail::safetensors_bytes_read() - before;
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(at::equal(got[r].at("weight"), whole->weight.detach().narrow(1, 8 * r, 8))) << "rank " << r;
    EXPECT_TRUE(at::equal(got[r].at("bias"), whole->bias.detach())) << "rank " << r;
  }
  EXPECT_EQ(read, whole->weight.nbytes() + 4 * whole->bias.nbytes())
      << "each rank reads its columns of the weight, and the bias it holds whole";
}

// FSDP at 8 ranks imports a model exported whole: each rank reads only
// the elements of each parameter its shard holds (with the one bias both
// of its neighbours may split), not the model. Before, each parameter
// entry was the whole parameter on every rank: 8 reads of the model.
TEST(Safetensors, EachFsdpRankReadsOnlyItsRangeOfTheFile) {
  testing::TempDir dir;
  const std::string out = dir.path() + "/hf";
  torch::manual_seed(6);
  torch::nn::Sequential whole(torch::nn::Linear(64, 48), torch::nn::Linear(48, 40));
  one_rank([&](const auto& group) {
    ckpt::DistributedState state;
    ckpt::add_module(state, *whole);
    ckpt::export_safetensors(out, state, ckpt::SafetensorsOptions().process_group(group));
  });
  int64_t model_bytes = 0;
  for (const auto& p : whole->parameters()) model_bytes += p.nbytes();
  constexpr int kRanks = 8;
  const uint64_t before = ckpt::detail::safetensors_bytes_read();
  std::vector<Tensors> got(kRanks);
  std::vector<int64_t> shard_bytes(kRanks);
  testing::expect_no_errors(testing::run_rank_contexts(kRanks, [&](RankContext& ctx) {
    torch::nn::Sequential model(torch::nn::Linear(64, 48), torch::nn::Linear(48, 40));
    FullyShardedDataParallel<torch::nn::SequentialImpl> fsdp(model.ptr(), FSDPOptions().process_group(ctx.group));
    for (const auto& s : fsdp.shard_layout()) shard_bytes[ctx.rank] += s.shard.nbytes();
    ckpt::DistributedState state;
    ckpt::add_fsdp_parameters(state, fsdp);
    ckpt::import_safetensors(out, state);
    got[ctx.rank] = fsdp.full_state_dict();
  }, 60s));
  const uint64_t read = ckpt::detail::safetensors_bytes_read() - before;
  for (int r = 0; r < kRanks; ++r)
    for (const auto& item : whole->named_parameters())
      EXPECT_TRUE(at::equal(got[r].at(item.key()), item.value().detach())) << "rank " << r << " " << item.key();
  // The ranks' ranges tile each parameter: together they read the model once.
  EXPECT_EQ(read, static_cast<uint64_t>(model_bytes));
  EXPECT_LT(shard_bytes[0], model_bytes / 4) << "a shard is an eighth of the model (and its padding)";
}

TEST(Safetensors, DamagedFilesAndMismatchesAreNamed) {
  testing::TempDir dir;
  const std::string out = dir.path() + "/hf";
  Net net;
  one_rank([&](const auto& group) {
    ckpt::DistributedState state;
    ckpt::add_module(state, *net);
    ckpt::export_safetensors(out, state, ckpt::SafetensorsOptions().process_group(group));
  });
  Net other;
  auto import_into = [&](const ckpt::SafetensorsOptions& options = {}) {
    ckpt::DistributedState into;
    ckpt::add_module(into, *other);
    return testing::what_thrown<InvalidArgument>([&] { ckpt::import_safetensors(out, into, options); });
  };
  EXPECT_EQ(import_into(ckpt::SafetensorsOptions().rename([](const std::string& e) {
              return e == "param/fc.weight" ? std::string("fc.bias") : e.substr(e.find('/') + 1);
            })),
            "import_safetensors " + out + "/model.safetensors: tensor 'fc.bias' has shape [3] in the file but [3, 4] here");
  EXPECT_EQ(import_into(ckpt::SafetensorsOptions().rename([](const std::string& e) {
              return e == "param/half" ? std::string("table") : e.substr(e.find('/') + 1);
            })),
            "import_safetensors " + out + "/model.safetensors: tensor 'table' is I64 in the file but BFloat16 here");
  EXPECT_EQ(import_into(ckpt::SafetensorsOptions().rename([](const std::string& e) { return "x." + e; })),
            "import_safetensors " + out + ": no file has tensor 'x.buffer/bn.num_batches_tracked' (for entry "
            "'buffer/bn.num_batches_tracked')");
  const std::string file = bytes_of(out + "/model.safetensors");
  std::ofstream(out + "/model.safetensors", std::ios::binary | std::ios::trunc) << file.substr(0, 100);
  EXPECT_TRUE(testing::Contains(import_into(), "safetensors " + out + "/model.safetensors: header length "));
  EXPECT_TRUE(testing::Contains(import_into(), "runs past the end of the file (100 bytes)"));
}

// Experts go out as Hugging Face names them, one tensor per expert: an MoE
// at EP 2 (each rank half the experts) exports w1, w3 and w2 [8, ...] as
// experts.{e}.gate_proj.weight, up_proj and down_proj, each [hidden, dim] or
// [dim, hidden], equal to one process's expert e; the router and shared
// expert under their module names. They import back into one process
// (stacked) and at EP 2 (each rank only its experts' tensors) bitwise.
TEST(Safetensors, ExpertsGoOutOneTensorPerExpertUnderHuggingFaceNamesAndComeBackAtAnyEpSize) {
  testing::TempDir dir;
  const std::string out = dir.path() + "/hf";
  namespace ep = expert_parallel;
  const auto options = ep::MoEOptions(8, 16, 8).top_k(2).shared_expert_hidden_dim(12).load_balance_coeff(1e-3);
  std::mutex generator;  // libtorch's is the process's
  auto seeded = [&](const ep::MoEOptions& o, uint64_t seed) {
    std::lock_guard<std::mutex> lock(generator);
    torch::manual_seed(seed);
    return ep::MoE(o);
  };
  ep::MoE whole = seeded(options, 5);
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
    auto moe = seeded(ep::MoEOptions(options).ep_group(ctx.group), 5);
    ckpt::DistributedState state;
    ckpt::add_module(state, *moe, "model/");
    ckpt::export_safetensors(out, state, ckpt::SafetensorsOptions().process_group(ctx.group));
  }));
  const Tensors files = read_by_the_spec(out + "/model.safetensors");
  EXPECT_EQ(files.size(), 3u * 8u + 4u + 2u) << "24 expert tensors, router, shared expert x3, two buffers";
  const std::pair<const char*, at::Tensor> kinds[] = {
      {"gate_proj", whole->experts->w1}, {"up_proj", whole->experts->w3}, {"down_proj", whole->experts->w2}};
  for (int e = 0; e < 8; ++e)
    for (const auto& [kind, all] : kinds) {
      const std::string name = "experts." + std::to_string(e) + "." + kind + ".weight";
      ASSERT_TRUE(files.count(name)) << name;
      EXPECT_TRUE(at::equal(files.at(name), all[e])) << name;
    }
  EXPECT_TRUE(at::equal(files.at("router.gate.weight"), whole->router->gate->weight));
  EXPECT_TRUE(at::equal(files.at("shared_expert.w2.weight"), whole->shared_expert->w2->weight));
  EXPECT_FALSE(files.count("experts.w1"));

  auto other = seeded(options, 6);
  ckpt::DistributedState into;
  ckpt::add_module(into, *other);
  ckpt::import_safetensors(out, into);
  expect_equal(state_dict_of(*other), state_dict_of(*whole), "imported into one process");
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
    auto moe = seeded(ep::MoEOptions(options).ep_group(ctx.group), 7);
    ckpt::DistributedState state;
    ckpt::add_module(state, *moe);
    ckpt::import_safetensors(out, state);
    EXPECT_TRUE(at::equal(moe->experts->w1, whole->experts->w1.narrow(0, 4 * ctx.rank, 4)));
    EXPECT_TRUE(at::equal(moe->experts->w2, whole->experts->w2.narrow(0, 4 * ctx.rank, 4)));
    EXPECT_TRUE(at::equal(moe->router->gate->weight, whole->router->gate->weight));
  }));
}

}  // namespace
}  // namespace dtrain
