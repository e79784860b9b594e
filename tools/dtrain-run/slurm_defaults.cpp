#include "slurm_defaults.h"

#include <netdb.h>
#include <sys/socket.h>

#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "common/slurm.h"
#include "dtrain/errors.h"

namespace dtrain::run {
namespace {

bool resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (found) freeaddrinfo(found);
  return rc == 0;
}

// Sets `name` unless it is set; notes it in `said`.
void default_to(const char* name, const std::string& value, std::ostringstream& said) {
  if (std::getenv(name)) return;
  setenv(name, value.c_str(), 0);
  said << " " << name << "=" << value;
}

}  // namespace

std::string apply_slurm_defaults() {
  const char* nnodes = std::getenv("SLURM_NNODES");
  const char* ntasks = std::getenv("SLURM_NTASKS");
  const char* node_id = std::getenv("SLURM_NODEID");
  if (!nnodes || !ntasks || !node_id || std::string(nnodes) != ntasks) return "";
  std::ostringstream said;
  default_to("PET_NNODES", nnodes, said);
  default_to("PET_NODE_RANK", node_id, said);
  try {
    if (auto host = slurm::master_addr_from_slurm()) {
      if (!resolves(*host))
        if (auto known = slurm::node_addr(*host)) host = known;
      default_to("PET_MASTER_ADDR", *host, said);
    }
    if (auto port = slurm::master_port_from_slurm())
      default_to("PET_MASTER_PORT", std::to_string(*port), said);
  } catch (const InvalidArgument& e) {
    throw std::runtime_error(e.what());
  }
  const std::string set = said.str();
  return set.empty() ? "" : "from Slurm (one launcher per node):" + set;
}

}  // namespace dtrain::run
