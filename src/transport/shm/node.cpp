#include "transport/shm/node.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>

#include "common/enforce.h"
#include "common/env.h"

namespace dtrain::shm {
namespace {
thread_local std::string thread_host_id;
}

void set_thread_host_id(const std::string& id) { thread_host_id = id; }

std::string node_key() {
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  if (boot_id.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    boot_id = host;
  }
  struct stat netns {}, shm_dir {};
  ::stat("/proc/self/ns/net", &netns);
  ::stat("/dev/shm", &shm_dir);
  std::string key = detail::cat(boot_id, "/net:", netns.st_ino, "/shm:", shm_dir.st_dev);
  if (auto id = env::get(env::kHostId); id && !id->empty()) key += "/id:" + *id;
  if (!thread_host_id.empty()) key += "/thread:" + thread_host_id;
  return key;
}

std::vector<std::vector<int>> group_by_node(const std::vector<std::string>& keys) {
  std::map<std::string, size_t> index;
  std::vector<std::vector<int>> nodes;
  for (int r = 0; r < static_cast<int>(keys.size()); ++r) {
    auto [it, fresh] = index.emplace(keys[r], nodes.size());
    if (fresh) nodes.emplace_back();
    nodes[it->second].push_back(r);
  }
  return nodes;
}

}  // namespace dtrain::shm
