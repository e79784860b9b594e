#pragma once

// Where libtorch's releases differ, the rest of dtrain calls these (one
// place, as pybind11's detail/common.h does for compilers). Supported: 1.13
// (Debian 12), 2.6 (Debian 13), PyTorch's own 2.x, 2.14 (Debian unstable).
//
// Each shim detects what it needs from the API itself (a member, a type),
// not from a version number, so a release in between that made the change
// earlier or later still gets the right branch.
//
//   NodePtr            an owning pointer to an autograd node: std::shared_ptr
//                      in 1.13 to 2.11, c10::intrusive_ptr in 2.14
//   make_node<T>(...)  makes a node of type T held by the right pointer
//   pointer_text(p)    a pointer as libtorch's 1.13 optimizers printed it into
//                      their state keys (c10::guts::to_string is gone in 2.6)
//   disable_libuv(o)   a TCPStore client never needs libuv; from 2.4 a store
//                      asks for it by default and fails where PyTorch was
//                      built without it (Debian's 2.6 and 2.14)

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace dtrain::compat {

using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

inline constexpr bool kNodesAreShared =
    std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;

template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (kNodesAreShared)
    return std::make_shared<T>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
}

inline std::string pointer_text(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

template <typename Options, typename = void>
struct HasUseLibUV : std::false_type {};
template <typename Options>
struct HasUseLibUV<Options, std::void_t<decltype(std::declval<Options&>().useLibUV)>>
    : std::true_type {};

template <typename Options>
void disable_libuv(Options& options) {
  if constexpr (HasUseLibUV<Options>::value) options.useLibUV = false;
}

}  // namespace dtrain::compat
