#include "ddp/model_sync.h"

#include <ATen/core/grad_mode.h>  // at::NoGradGuard (its own header on libtorch 2.x)

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>

#include "common/enforce.h"
#include "core/control_tensors.h"

namespace dtrain::ddp {
namespace {

std::string describe(const std::string& name, const at::Tensor& t) {
  std::ostringstream out;
  out << "'" << name << "' " << t.scalar_type() << " " << t.sizes();
  return out.str();
}

std::vector<at::Tensor> gather_rows(ProcessGroup& group, const at::Tensor& row) {
  return detail::all_gather_control(group, row);
}

}  // namespace

void verify_same_model(ProcessGroup& group, const std::vector<std::string>& names,
                       const std::vector<at::Tensor>& tensors,
                       const char* who) {
  // 1. Counts, so every rank can size the next exchange.
  auto counts = gather_rows(group, at::full({1}, static_cast<int64_t>(tensors.size()), at::kLong));
  int64_t max_count = 0;
  for (auto& c : counts) max_count = std::max(max_count, c.item<int64_t>());
  // 2. One hash per parameter (name, dtype, shape), padded with -1.
  auto row = at::full({max_count}, -1, at::kLong);
  for (size_t i = 0; i < tensors.size(); ++i)
    row[static_cast<int64_t>(i)] = static_cast<int64_t>(
        std::hash<std::string>()(describe(names[i], tensors[i])) & 0x7fffffffffffffffULL);
  auto rows = gather_rows(group, row);
  int64_t first_bad = -1;
  for (int64_t i = 0; i < max_count && first_bad < 0; ++i)
    for (const auto& r : rows)
      if (r[i].item<int64_t>() != rows[0][i].item<int64_t>()) {
        first_bad = i;
        break;
      }
  if (first_bad < 0) return;
  // 3. What each rank has at the first difference (every rank learns the
  //    same index, so this exchange matches everywhere).
  constexpr int64_t kWidth = 256;
  auto text = at::zeros({kWidth}, at::kByte);
  std::string mine = first_bad < static_cast<int64_t>(tensors.size())
                         ? describe(names[first_bad], tensors[first_bad])
                         : "nothing (only " + std::to_string(tensors.size()) + " parameters)";
  std::memcpy(text.data_ptr<uint8_t>(), mine.data(), std::min<size_t>(mine.size(), kWidth - 1));
  auto texts = gather_rows(group, text);
  std::vector<std::string> per_rank;
  for (int r = 0; r < group.size(); ++r)
    per_rank.push_back(detail::cat("rank ", r, " has ",
                                   reinterpret_cast<const char*>(texts[r].data_ptr<uint8_t>())));
  throw InvalidArgument(detail::cat(
      who, ": the model differs across ranks at parameter #", first_bad, ": ",
      detail::join(per_rank, "; "),
      ". Every rank must wrap the same model: the same parameter names, dtypes and shapes, "
      "registered in the same order."));
}

void broadcast_coalesced(ProcessGroup& group, const std::vector<at::Tensor>& tensors, int src) {
  if (group.size() == 1 || tensors.empty()) return;
  at::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  for (const auto& t : tensors) by_type[t.scalar_type()].push_back(t);
  for (auto& [type, ts] : by_type) {
    std::vector<at::Tensor> flat;
    for (const auto& t : ts) flat.push_back(t.detach().reshape({-1}));
    auto packed = at::cat(flat);
    group.broadcast(packed, src)->wait();
    int64_t off = 0;
    for (auto& t : ts) {
      t.detach().copy_(packed.narrow(0, off, t.numel()).view_as(t));
      off += t.numel();
    }
  }
}

}  // namespace dtrain::ddp
