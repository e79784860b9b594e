// Tensor files as a user saves and loads them: every stored dtype comes
// back bit for bit (non-contiguous and empty tensors too) with the
// metadata; what cannot be stored is refused by name; a damaged file names
// the file and the problem; a failed or killed save leaves the previous
// file in place and no temporary file behind.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "dtrain/checkpoint/tensor_file.h"
#include "dtrain/errors.h"
#include "harness/assertions.h"

namespace {

using dtrain::checkpoint::load_tensor_file;
using dtrain::checkpoint::save_tensor_file;
using dtrain::checkpoint::TensorFile;
using dtrain::testing::Contains;
using dtrain::testing::what_thrown;

std::string temp_path(const std::string& name) {
  return "/tmp/dtrain-tensor-file-" + std::to_string(getpid()) + "-" + name;
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TensorFile sample() {
  TensorFile f;
  torch::manual_seed(5);
  const torch::ScalarType types[] = {torch::kFloat, torch::kDouble, torch::kHalf,
                                     torch::kBFloat16, torch::kLong, torch::kInt,
                                     torch::kShort, torch::kChar, torch::kByte,
                                     torch::kBool, torch::kComplexFloat, torch::kComplexDouble};
  for (auto type : types) {
    auto t = torch::randn({3, 5}, torch::kDouble).mul(40).to(type);
    f.tensors[std::string("t.") + c10::toString(type)] = t;
  }
  f.tensors["transposed"] = torch::arange(12, torch::kFloat).reshape({3, 4}).t();
  f.tensors["empty"] = torch::empty({0, 7});
  f.tensors["scalar"] = torch::tensor(2.5);
  f.metadata["epoch"] = "3";
  f.metadata["binary"] = std::string("a\0b", 3);
  return f;
}

TEST(TensorFile, EveryDtypeRoundTripsBitForBit) {
  const auto path = temp_path("all.dtt");
  const TensorFile saved = sample();
  save_tensor_file(path, saved);
  EXPECT_FALSE(exists(path + ".tmp"));
  const TensorFile loaded = load_tensor_file(path);
  EXPECT_EQ(loaded.metadata, saved.metadata);
  ASSERT_EQ(loaded.tensors.size(), saved.tensors.size());
  for (const auto& [name, t] : saved.tensors) {
    ASSERT_TRUE(loaded.tensors.count(name)) << name;
    EXPECT_TRUE(same_bits(loaded.tensors.at(name), t)) << name;
    EXPECT_TRUE(loaded.tensors.at(name).is_contiguous()) << name;
  }
  unlink(path.c_str());
}

TEST(TensorFile, WhatCannotBeStoredIsRefusedByName) {
  const auto path = temp_path("bad.dtt");
  TensorFile f;
  f.tensors["sparse"] = torch::eye(3).to_sparse();
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { save_tensor_file(path, f); }),
                       "tensor file: tensor sparse is not a dense tensor"));
  f.tensors.clear();
  f.tensors["u"] = torch::Tensor();
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { save_tensor_file(path, f); }),
                       "tensor file: tensor u is undefined"));
  f.tensors.clear();
  f.tensors[""] = torch::ones({1});
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { save_tensor_file(path, f); }),
                       "tensor file: a tensor has an empty name"));
  EXPECT_FALSE(exists(path));
  EXPECT_FALSE(exists(path + ".tmp"));
}

TEST(TensorFile, DamagedFilesNameTheFileAndTheProblem) {
  const auto path = temp_path("damaged.dtt");
  save_tensor_file(path, sample());
  const std::string good = read_all(path);
  const std::string what = "tensor file " + path + ": ";

  write_all(path, good.substr(0, good.size() - 10));
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { load_tensor_file(path); }),
                       what + "truncated: " + std::to_string(good.size() - 10) + " bytes"));
  std::string flipped = good;
  flipped[flipped.size() - 1] ^= 0x10;  // in the last tensor's bytes
  write_all(path, flipped);
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { load_tensor_file(path); }),
                       what + "tensor transposed is corrupt (checksum mismatch)"));
  write_all(path, "PK\3\4 a zip archive, as torch::save writes");
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { load_tensor_file(path); }),
                       what + "not a dtrain tensor file"));
  unlink(path.c_str());
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { load_tensor_file(path); }),
                       what + "cannot open: No such file or directory"));
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { load_tensor_file("/tmp"); }),
                       "tensor file /tmp: not a regular file"));
}

// The header claims a 1 TiB tensor in a file of a few hundred bytes: the
// size is compared with the file before anything is allocated.
TEST(TensorFile, SizesBeyondTheFileAreRefusedBeforeAllocating) {
  const auto path = temp_path("huge.dtt");
  TensorFile f;
  f.tensors["x"] = torch::ones({4});
  save_tensor_file(path, f);
  std::string bytes = read_all(path);
  const uint64_t tib = uint64_t{1} << 40;
  std::memcpy(&bytes[16], &tib, 8);  // the data size in the preamble
  write_all(path, bytes);
  EXPECT_TRUE(Contains(what_thrown<dtrain::InvalidArgument>([&] { load_tensor_file(path); }),
                       "tensor file " + path + ": truncated: " + std::to_string(bytes.size()) +
                           " bytes; its header describes " +
                           std::to_string(bytes.size() - 16 + tib)));
  unlink(path.c_str());
}

TEST(TensorFile, FailedFsyncKeepsThePreviousFile) {
  const auto path = temp_path("fsync.dtt");
  TensorFile one, two;
  one.tensors["v"] = torch::full({2}, 1.0);
  two.tensors["v"] = torch::full({2}, 2.0);
  save_tensor_file(path, one);
  dtrain::checkpoint::WriteFaults faults;
  faults.fsync_errno = EIO;
  EXPECT_TRUE(Contains(what_thrown<dtrain::Error>([&] { save_tensor_file(path, two, faults); }),
                       "cannot save tensor file " + path + ": cannot fsync " + path +
                           ".tmp: Input/output error"));
  EXPECT_FALSE(exists(path + ".tmp"));
  EXPECT_TRUE(same_bits(load_tensor_file(path).tensors.at("v"), one.tensors.at("v")));
  unlink(path.c_str());
}

// A writer killed half way (a child process SIGKILLs itself): the previous
// file is intact under the name; the partial one is only the .tmp.
TEST(TensorFile, WriterKilledHalfWayLeavesThePreviousFile) {
  const auto path = temp_path("killed.dtt");
  TensorFile one, two;
  one.tensors["v"] = torch::full({1000}, 1.0);
  two.tensors["v"] = torch::full({1000}, 2.0);
  save_tensor_file(path, one);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    dtrain::checkpoint::WriteFaults faults;
    faults.die_while_writing = true;
    save_tensor_file(path, two, faults);
    _exit(0);  // not reached: the hook kills the writer
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  EXPECT_TRUE(exists(path + ".tmp"));
  EXPECT_TRUE(same_bits(load_tensor_file(path).tensors.at("v"), one.tensors.at("v")));
  EXPECT_TRUE(Contains(
      what_thrown<dtrain::InvalidArgument>([&] { load_tensor_file(path + ".tmp"); }),
      "truncated"));
  unlink(path.c_str());
  unlink((path + ".tmp").c_str());
}

}  // namespace
