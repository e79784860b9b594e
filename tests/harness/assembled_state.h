#pragma once

// The whole of a distributed checkpoint's state, assembled from what ranks
// add: replicated entries by name (replicas' copies overwrite each other),
// each sharded entry from its pieces. Thread-safe: rank threads add to it.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>

#include "dtrain/checkpoint/distributed.h"

namespace dtrain::testing {

class AssembledState {
 public:
  void add(const checkpoint::DistributedState& state) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [name, s] : state.sharded) {
      auto& whole = tensors_[name];
      if (!whole.defined()) whole = torch::full({s.numel}, std::nan(""), s.local.options());
      whole.narrow(0, s.offset, s.local.numel()).copy_(s.local.detach());
    }
    for (const auto& [name, t] : state.replicated) tensors_[name] = t.detach().clone();
  }
  // The same names, bitwise the same values.
  void expect_equal(const AssembledState& other) const {
    ASSERT_EQ(tensors_.size(), other.tensors_.size());
    for (const auto& [name, t] : tensors_) {
      ASSERT_TRUE(other.tensors_.count(name)) << name;
      EXPECT_TRUE(torch::equal(t, other.tensors_.at(name))) << name << " differs";
    }
  }
  size_t size() const { return tensors_.size(); }
  int64_t bytes() const {
    int64_t n = 0;
    for (const auto& [name, t] : tensors_) n += static_cast<int64_t>(t.nbytes());
    return n;
  }

 private:
  std::mutex mutex_;
  std::map<std::string, torch::Tensor> tensors_;
};

}  // namespace dtrain::testing
