#include "transport/topology.h"

#include <algorithm>

#include "common/enforce.h"
#include "transport/shm/node.h"

namespace dtrain::transport {

Topology::Topology(std::vector<std::vector<int>> hosts_) : hosts(std::move(hosts_)) {
  int n = 0;
  for (const auto& h : hosts) n += static_cast<int>(h.size());
  host_of.assign(n, -1);
  local_index.assign(n, -1);
  for (size_t h = 0; h < hosts.size(); ++h)
    for (size_t i = 0; i < hosts[h].size(); ++i) {
      const int r = hosts[h][i];
      DTRAIN_ENFORCE(r >= 0 && r < n && host_of[r] < 0);
      host_of[r] = static_cast<int>(h);
      local_index[r] = static_cast<int>(i);
    }
}

Topology Topology::host_per_rank(int size) {
  std::vector<std::vector<int>> hosts;
  for (int r = 0; r < size; ++r) hosts.push_back({r});
  return Topology(std::move(hosts));
}

Topology Topology::one_host(int size) {
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  return Topology({std::move(ranks)});
}

bool Topology::uniform() const {
  return std::all_of(hosts.begin(), hosts.end(),
                     [&](const auto& h) { return h.size() == hosts.front().size(); });
}

std::string Topology::describe() const {
  std::vector<std::string> parts;
  for (const auto& h : hosts) parts.push_back("ranks " + detail::join(h, ","));
  return detail::cat(hosts.size(), hosts.size() == 1 ? " host (" : " hosts (",
                     detail::join(parts, " | "), ")");
}

Topology discover_topology(Store& store, int rank, int size) {
  store.set(detail::cat("topology/host/", rank), shm::node_key());
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r)
    keys.push_back(store.get_string(detail::cat("topology/host/", r)));
  return Topology(shm::group_by_node(keys));
}

}  // namespace dtrain::transport
