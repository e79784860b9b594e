#pragma once

// Object collectives (torch.distributed's broadcast_object_list,
// all_gather_object, gather_object, scatter_object_list, send/recv_object)
// for C++ values, with no pickling: a value travels as bytes through
// ObjectCodec<T>, which dtrain provides for std::string (the bytes
// themselves), trivially copyable types (their object representation) and
// std::vector of those. Specialize ObjectCodec for your own types.
//
// Every rank's object may have a different size: the sizes are exchanged
// first, then the bytes (padded to the largest, as PyTorch does). Ranks
// (src, dst) are global ranks, as in the tensor collectives; options pick
// the group and the timeout. Every call blocks. On nccl the bytes go through
// the group's control device (its GPU).
//
// Bytes from another rank are checked before use: a size that is not a
// whole T is InvalidArgument naming the rank and the sizes.

#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/distributed.h"
#include "dtrain/errors.h"

namespace dtrain {

template <typename T, typename Enable = void>
struct ObjectCodec;  // encode(const T&) -> std::string; decode(const std::string&) -> T

template <>
struct ObjectCodec<std::string> {
  static const std::string& encode(const std::string& s) { return s; }
  static std::string decode(const std::string& bytes) { return bytes; }
};

template <typename T>
struct ObjectCodec<T, std::enable_if_t<std::is_trivially_copyable_v<T>>> {
  static std::string encode(const T& v) {
    return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  static T decode(const std::string& bytes) {
    if (bytes.size() != sizeof(T))
      throw InvalidArgument("object collective: received " + std::to_string(bytes.size()) +
                            " bytes for a value of " + std::to_string(sizeof(T)) + " bytes");
    T v;
    std::memcpy(&v, bytes.data(), sizeof(T));
    return v;
  }
};

template <typename T>
struct ObjectCodec<std::vector<T>, std::enable_if_t<std::is_trivially_copyable_v<T>>> {
  static std::string encode(const std::vector<T>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  static std::vector<T> decode(const std::string& bytes) {
    if (bytes.size() % sizeof(T) != 0)
      throw InvalidArgument("object collective: received " + std::to_string(bytes.size()) +
                            " bytes, not a whole number of " + std::to_string(sizeof(T)) +
                            "-byte elements");
    std::vector<T> v(bytes.size() / sizeof(T));
    if (!bytes.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  }
};

// --- on byte strings --------------------------------------------------------
// src's bytes end up in `bytes` on every rank.
void broadcast_bytes(std::string& bytes, int src, const CollectiveOptions& options = CollectiveOptions());
// Every rank's bytes, in group-rank order.
std::vector<std::string> all_gather_bytes(const std::string& bytes,
                                          const CollectiveOptions& options = CollectiveOptions());
// On dst: every rank's bytes; elsewhere: empty.
std::vector<std::string> gather_bytes(const std::string& bytes, int dst,
                                      const CollectiveOptions& options = CollectiveOptions());
// src passes one string per group rank (others pass {}); each rank gets its own.
std::string scatter_bytes(const std::vector<std::string>& pieces, int src,
                          const CollectiveOptions& options = CollectiveOptions());
void send_bytes(const std::string& bytes, int dst, const P2POptions& options = P2POptions());
// From `src` or kAnySource; returns {bytes, sender's global rank}.
std::pair<std::string, int> recv_bytes(int src, const P2POptions& options = P2POptions());

// --- on values ----------------------------------------------------------------
template <typename T>
void broadcast_object(T& value, int src, const CollectiveOptions& options = CollectiveOptions()) {
  std::string bytes = ObjectCodec<T>::encode(value);
  broadcast_bytes(bytes, src, options);
  value = ObjectCodec<T>::decode(bytes);
}

template <typename T>
std::vector<T> all_gather_object(const T& value, const CollectiveOptions& options = CollectiveOptions()) {
  std::vector<T> out;
  for (const auto& bytes : all_gather_bytes(ObjectCodec<T>::encode(value), options))
    out.push_back(ObjectCodec<T>::decode(bytes));
  return out;
}

template <typename T>
std::vector<T> gather_object(const T& value, int dst, const CollectiveOptions& options = CollectiveOptions()) {
  std::vector<T> out;
  for (const auto& bytes : gather_bytes(ObjectCodec<T>::encode(value), dst, options))
    out.push_back(ObjectCodec<T>::decode(bytes));
  return out;
}

template <typename T>
T scatter_object_list(const std::vector<T>& values, int src,
                      const CollectiveOptions& options = CollectiveOptions()) {
  std::vector<std::string> pieces;
  for (const auto& v : values) pieces.push_back(ObjectCodec<T>::encode(v));
  return ObjectCodec<T>::decode(scatter_bytes(pieces, src, options));
}

template <typename T>
void send_object(const T& value, int dst, const P2POptions& options = P2POptions()) {
  send_bytes(ObjectCodec<T>::encode(value), dst, options);
}

// Returns the value; `sender` (when given) gets the sender's global rank.
template <typename T>
T recv_object(int src, const P2POptions& options = P2POptions(), int* sender = nullptr) {
  auto [bytes, from] = recv_bytes(src, options);
  if (sender) *sender = from;
  return ObjectCodec<T>::decode(bytes);
}

// Collective over `group`: agreeing on a failure. Every rank passes its
// own error ("" when its step succeeded). When any rank failed, every rank
// throws the same Error, "rank <r>: <error>", r the lowest failing rank of
// the group; one all_reduce when none failed. Call it after a step that can
// fail on some ranks only (writing a file, reading one), where a barrier
// would leave the others waiting for a rank that gave up.
void fail_together(ProcessGroup& group, const std::string& error);

}  // namespace dtrain
