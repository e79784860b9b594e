#pragma once

// Which ranks can share memory (no torch here). Two ranks are on the same
// "node" when they run on the same kernel (boot id), in the same network
// namespace and see the same /dev/shm mount. The network namespace is part
// of the key on purpose: a separate namespace usually means a separate
// container, and it is how tests stand in for separate machines.

#include <string>
#include <vector>

namespace dtrain::shm {

std::string node_key();

// Tests only: thread ranks of one process stand in for ranks on different
// hosts. While set (non-empty) on a thread, node_key() on that thread adds
// it as DTRAIN_HOST_ID would.
void set_thread_host_id(const std::string& id);

// Ranks grouped by node, in order of each node's lowest rank; ranks within a
// node ascending. keys[r] is rank r's node_key().
std::vector<std::vector<int>> group_by_node(const std::vector<std::string>& keys);

}  // namespace dtrain::shm
