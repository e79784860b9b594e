// Object collectives on byte strings (dtrain/objects.h): each is a size
// exchange, then the bytes padded to the largest size, through the tensor
// collectives on the group's control device.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "common/enforce.h"
#include "dtrain/objects.h"

namespace dtrain {
namespace {

std::shared_ptr<ProcessGroup> group_of(const std::shared_ptr<ProcessGroup>& group) {
  return group ? group : default_group();
}

CollectiveOptions blocking(CollectiveOptions options) { return options.async_op(false); }

// `length` bytes on the group's control device: the start of `bytes`, then zeros.
at::Tensor device_bytes(const ProcessGroup& g, const std::string& bytes, int64_t length) {
  auto host = at::zeros({length}, at::kByte);
  const auto n = std::min<int64_t>(length, static_cast<int64_t>(bytes.size()));
  if (n > 0) std::memcpy(host.data_ptr(), bytes.data(), static_cast<size_t>(n));
  return host.to(g.control_device());
}

std::string host_string(const at::Tensor& t, int64_t length) {
  auto host = t.cpu().contiguous();
  return std::string(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(length));
}

at::Tensor device_sizes(const ProcessGroup& g, const std::vector<int64_t>& sizes) {
  return at::tensor(sizes, at::kLong).to(g.control_device());
}

// A size another rank sent: checked before anything is allocated for it.
int64_t checked_size(int64_t n, const char* op, int rank) {
  DTRAIN_CHECK_ARG(n >= 0 && n <= (int64_t{1} << 40), op, ": rank ", rank,
                   " announced an object of ", n, " bytes");
  return n;
}

// Every rank's size, in group-rank order.
std::vector<int64_t> gather_sizes(const ProcessGroup& g, int64_t mine, const CollectiveOptions& o,
                                  const char* op) {
  auto size = device_sizes(g, {mine});
  std::vector<at::Tensor> rows;
  for (int r = 0; r < g.size(); ++r) rows.push_back(at::empty_like(size));
  all_gather(rows, size, blocking(o));
  std::vector<int64_t> sizes;
  for (int r = 0; r < g.size(); ++r) sizes.push_back(checked_size(rows[r].cpu().item<int64_t>(), op, r));
  return sizes;
}

}  // namespace

void broadcast_bytes(std::string& bytes, int src, const CollectiveOptions& o) {
  auto g = group_of(o.group());
  auto size = device_sizes(*g, {static_cast<int64_t>(bytes.size())});
  broadcast(size, src, blocking(o));
  const int64_t n = checked_size(size.cpu().item<int64_t>(), "broadcast_object", src);
  const bool root = g->rank() == g->group_rank_of(src);
  auto data = device_bytes(*g, root ? bytes : std::string(), n);
  if (n > 0) broadcast(data, src, blocking(o));
  bytes = host_string(data, n);
}

std::vector<std::string> all_gather_bytes(const std::string& bytes, const CollectiveOptions& o) {
  auto g = group_of(o.group());
  const auto sizes = gather_sizes(*g, static_cast<int64_t>(bytes.size()), o, "all_gather_object");
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<std::string> out(sizes.size());
  if (longest == 0) return out;
  auto mine = device_bytes(*g, bytes, longest);
  std::vector<at::Tensor> rows;
  for (int r = 0; r < g->size(); ++r) rows.push_back(at::empty_like(mine));
  all_gather(rows, mine, blocking(o));
  for (size_t r = 0; r < sizes.size(); ++r) out[r] = host_string(rows[r], sizes[r]);
  return out;
}

std::vector<std::string> gather_bytes(const std::string& bytes, int dst, const CollectiveOptions& o) {
  auto g = group_of(o.group());
  const auto sizes = gather_sizes(*g, static_cast<int64_t>(bytes.size()), o, "gather_object");
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  const bool root = g->rank() == g->group_rank_of(dst);
  std::vector<std::string> out(root ? sizes.size() : 0);
  if (longest == 0) return out;
  auto mine = device_bytes(*g, bytes, longest);
  std::vector<at::Tensor> rows;
  for (int r = 0; root && r < g->size(); ++r) rows.push_back(at::empty_like(mine));
  gather(mine, rows, dst, blocking(o));
  for (size_t r = 0; root && r < sizes.size(); ++r) out[r] = host_string(rows[r], sizes[r]);
  return out;
}

std::string scatter_bytes(const std::vector<std::string>& pieces, int src, const CollectiveOptions& o) {
  auto g = group_of(o.group());
  const bool root = g->rank() == g->group_rank_of(src);
  if (root)
    DTRAIN_CHECK_ARG(static_cast<int>(pieces.size()) == g->size(), "scatter_object_list: ",
                     pieces.size(), " objects for a group of ", g->size(), " ranks");
  std::vector<int64_t> announced(static_cast<size_t>(g->size()), 0);
  for (size_t r = 0; root && r < pieces.size(); ++r) announced[r] = static_cast<int64_t>(pieces[r].size());
  auto sizes = device_sizes(*g, announced);
  broadcast(sizes, src, blocking(o));
  auto host_sizes = sizes.cpu();
  int64_t longest = 0;
  for (int r = 0; r < g->size(); ++r)
    longest = std::max(longest, checked_size(host_sizes[r].item<int64_t>(), "scatter_object_list", src));
  const int64_t mine = host_sizes[g->rank()].item<int64_t>();
  if (longest == 0) return "";
  auto out = device_bytes(*g, "", longest);
  std::vector<at::Tensor> inputs;
  for (size_t r = 0; root && r < pieces.size(); ++r) inputs.push_back(device_bytes(*g, pieces[r], longest));
  scatter(out, inputs, src, blocking(o));
  return host_string(out, mine);
}

void send_bytes(const std::string& bytes, int dst, const P2POptions& o) {
  auto g = group_of(o.group());
  send(device_sizes(*g, {static_cast<int64_t>(bytes.size())}), dst, o);
  if (!bytes.empty()) send(device_bytes(*g, bytes, static_cast<int64_t>(bytes.size())), dst, o);
}

std::pair<std::string, int> recv_bytes(int src, const P2POptions& o) {
  auto g = group_of(o.group());
  auto size = device_sizes(*g, {0});
  const int from = recv(size, src, o);  // the sender's global rank (src may be kAnySource)
  const int64_t n = checked_size(size.cpu().item<int64_t>(), "recv_object", from);
  auto data = device_bytes(*g, "", n);
  if (n > 0) recv(data, from, o);
  return {host_string(data, n), from};
}

void fail_together(ProcessGroup& group, const std::string& error) {
  const auto on = at::TensorOptions().dtype(at::kLong).device(group.control_device());
  const int64_t none = group.size();
  auto first = at::full({1}, error.empty() ? none : static_cast<int64_t>(group.rank()), on);
  group.all_reduce(first, ReduceOp::MIN)->wait();
  const int64_t failed = first.cpu().item<int64_t>();
  if (failed == none) return;
  const int root = static_cast<int>(failed);
  auto length = at::full({1}, static_cast<int64_t>(error.size()), on);
  group.broadcast(length, root)->wait();
  const int64_t n = length.cpu().item<int64_t>();
  auto text = device_bytes(group, group.rank() == root ? error : std::string(), n);
  group.broadcast(text, root)->wait();
  throw Error("rank " + std::to_string(root) + ": " + host_string(text, n));
}

}  // namespace dtrain
