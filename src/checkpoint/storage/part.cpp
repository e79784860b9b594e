#include "checkpoint/storage/part.h"

#include <sstream>

#include "common/enforce.h"
#include "dtrain/checkpoint/tensor_file.h"

namespace dtrain::checkpoint::snapshot_part {
namespace {

constexpr char kStep[] = "snapshot/step", kRank[] = "snapshot/rank", kWorld[] = "snapshot/world";

// Where a sharded entry's piece lies in its whole: it must be the same
// when restored.
std::string geometry(const ShardedTensor& s) {
  std::ostringstream out;
  out << s.numel << " " << s.offset;
  for (auto d : s.shape) out << " s" << d;
  for (auto o : s.offsets) out << " o" << o;
  return out.str();
}

const std::string& field(const TensorFile& f, const std::string& key, const std::string& what) {
  auto it = f.metadata.find(key);
  DTRAIN_CHECK_ARG(it != f.metadata.end(), what, ": has no ", key);
  return it->second;
}

void expect_fits(const at::Tensor& saved, const at::Tensor& into, const std::string& name, const std::string& what) {
  DTRAIN_CHECK_ARG(saved.sizes() == into.sizes() && saved.scalar_type() == into.scalar_type(), what, ": ", name,
                   " was ", saved.scalar_type(), " ", saved.sizes(), " when the snapshot was taken; the state has ",
                   into.scalar_type(), " ", into.sizes());
}

}  // namespace

std::string encode(const storage::Part& part, int64_t step, int rank, int world) {
  TensorFile f;
  for (const auto& [name, t] : part.replicated) f.tensors["r/" + name] = t;
  for (const auto& [name, s] : part.sharded) {
    f.tensors["s/" + name] = s.local;
    f.metadata["g/" + name] = geometry(s);
  }
  for (const auto& [key, value] : part.metadata) f.metadata["u/" + key] = value;
  f.metadata[kStep] = std::to_string(step);
  f.metadata[kRank] = std::to_string(rank);
  f.metadata[kWorld] = std::to_string(world);
  return encode_tensor_file(f);
}

Decoded check(const std::string& bytes, const DistributedState& state, int64_t step, int rank, int world,
              const std::string& what) {
  const TensorFile f = decode_tensor_file(bytes, what);
  DTRAIN_CHECK_ARG(field(f, kStep, what) == std::to_string(step) && field(f, kRank, what) == std::to_string(rank) &&
                       field(f, kWorld, what) == std::to_string(world),
                   what, ": holds rank ", field(f, kRank, what), " of ", field(f, kWorld, what), " at step ",
                   field(f, kStep, what), ", not rank ", rank, " of ", world, " at step ", step);
  Decoded out;
  size_t expected = 0;
  auto take = [&](const std::string& key, const at::Tensor& into, const std::string& name) {
    auto it = f.tensors.find(key);
    DTRAIN_CHECK_ARG(it != f.tensors.end(), what, ": has no ", name, ", which the state holds");
    expect_fits(it->second, into, name, what);
    out.fills.emplace_back(into, it->second);
    ++expected;
    return it->second;
  };
  for (const auto& [name, t] : state.replicated) {
    if (f.tensors.count("r/" + name))
      out.owned[name] = take("r/" + name, t, name);
    else
      out.needs.push_back(name);
  }
  for (const auto& [name, s] : state.sharded) {
    take("s/" + name, s.local, name);
    auto g = f.metadata.find("g/" + name);
    DTRAIN_CHECK_ARG(g != f.metadata.end() && g->second == geometry(s), what, ": ", name,
                     " was another piece of its whole when the snapshot was taken (",
                     g == f.metadata.end() ? std::string("none") : g->second, " against ", geometry(s),
                     "): restore needs the snapshot's layout");
  }
  for (const auto& [key, t] : f.tensors) {
    const std::string name = key.size() > 2 ? key.substr(2) : key;
    const bool held = key.rfind("r/", 0) == 0 ? state.replicated.count(name) > 0
                      : key.rfind("s/", 0) == 0 ? state.sharded.count(name) > 0
                                                : false;
    DTRAIN_CHECK_ARG(held, what, ": holds ", key, ", which the state does not");
  }
  DTRAIN_ENFORCE_EQ(expected, f.tensors.size());
  for (const auto& [key, value] : f.metadata)
    if (key.rfind("u/", 0) == 0) out.metadata[key.substr(2)] = value;
  return out;
}

}  // namespace dtrain::checkpoint::snapshot_part
