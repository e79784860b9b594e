#pragma once

// Builder-style option fields, spelled like libtorch's TORCH_ARG so options
// read the same as torch::nn options:
//   dtrain::TcpStoreOptions().host("10.0.0.1").port(29500).timeout(30s)
// Kept here (and not taken from <torch/arg.h>) so that torch-free headers
// such as the store's stay torch-free.

#include <utility>

#define DTRAIN_ARG(T, name)                                      \
 public:                                                         \
  inline auto name(const T& new_##name) -> decltype(*this) {     \
    this->name##_ = new_##name;                                  \
    return *this;                                                \
  }                                                              \
  inline auto name(T&& new_##name) -> decltype(*this) {          \
    this->name##_ = std::move(new_##name);                       \
    return *this;                                                \
  }                                                              \
  inline const T& name() const noexcept { return this->name##_; } \
  inline T& name() noexcept { return this->name##_; }            \
                                                                 \
 private:                                                        \
  T name##_
