// init_process_group's rendezvous. Sources of rank and world size, in order:
// InitOptions, RANK/WORLD_SIZE (torchrun, dtrain-run), OMPI_COMM_WORLD_*
// (mpirun), SLURM_PROCID/SLURM_NTASKS (srun). The store comes from
// InitOptions::store, or the init_method: env:// and tcp:// put a TCP store
// server on rank 0 (or, under torchrun's agent, join the agent's store),
// file:// uses a FileStore.

#include "world/rendezvous.h"

#include <algorithm>
#include <climits>
#include <optional>

#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/slurm.h"
#include "common/socket.h"
#include "dtrain/store/file_store.h"
#include "dtrain/store/prefix_store.h"
#include "dtrain/store/tcp_store.h"
#include "world/local_address.h"
#include "store/agent_store.h"
#include "store/auth.h"

namespace dtrain {
namespace {

struct HostPort {
  std::string host;
  uint16_t port;
};

// "host:port" or "[v6]:port" from a tcp:// init_method.
HostPort parse_tcp_url(const std::string& url) {
  const std::string rest = url.substr(6);
  std::string host, port;
  if (!rest.empty() && rest[0] == '[') {
    auto close = rest.find(']');
    DTRAIN_CHECK_ARG(close != std::string::npos && close + 1 < rest.size() && rest[close + 1] == ':',
                     "init_method '", url, "' is malformed (expected tcp://[v6addr]:port)");
    host = rest.substr(1, close - 1);
    port = rest.substr(close + 2);
  } else {
    auto colon = rest.rfind(':');
    DTRAIN_CHECK_ARG(colon != std::string::npos && colon > 0, "init_method '", url,
                     "' is malformed (expected tcp://host:port)");
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  return {host, net::parse_port(port, "init_method '" + url + "' port")};
}

int resolve_int(int given, const char* option, std::initializer_list<const env::Var*> vars,
                long long lo, long long hi) {
  if (given != -1) {
    DTRAIN_CHECK_ARG(given >= lo && given <= hi, "InitOptions::", option, "(", given,
                     ") is out of range (expected ", lo, "..", hi, ")");
    return given;
  }
  for (const auto* var : vars)
    if (auto v = env::get_int(*var, lo, hi)) return static_cast<int>(*v);
  std::vector<std::string> names;
  for (const auto* var : vars) names.push_back(var->name);
  throw InvalidArgument(detail::cat("cannot determine the ", option,
                                    ": pass InitOptions().", option, "(...) or set one of ",
                                    detail::join(names)));
}

bool truthy(const std::string& v) {
  std::string s = v;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s == "1" || s == "true" || s == "yes";
}

// The address peers should use for our tcp sockets when a master host is
// known (env://, tcp://): the interface the user named, else the one that
// routes towards the master. Empty: found through the store (file://, a
// user's store; see world/local_address.h).
std::string address_from_environment(const std::string& master_host) {
  auto ifname = env::get(env::kSocketIfname);
  if (!ifname) ifname = env::get(env::kGlooSocketIfname);
  if (ifname) return net::interface_address(*ifname);
  if (master_host.empty()) return "";
  if (net::is_loopback(master_host)) return "127.0.0.1";
  return net::local_address_towards(master_host);
}

// Every rank announces itself and waits for all others: O(1) store
// operations per rank (a counter; the last rank to arrive sets one release
// key), so a 1,024-rank join is 3,072 requests, not a million key checks.
// On timeout the message says who is missing (the per-rank keys are read
// then only). The rank that hosts the store waits a moment longer, so the
// others can still ask it who is missing before it exits.
void join_barrier(Store& store, int rank, int world, std::chrono::milliseconds timeout,
                  bool hosts_store) {
  store.set("joined/" + std::to_string(rank), "1");
  if (store.add("joined/count", 1) == world) store.set("joined/all", "1");
  try {
    store.wait({"joined/all"}, hosts_store ? timeout + std::chrono::seconds(1) : timeout);
  } catch (const TimeoutError&) {
    std::vector<int> missing;
    for (int r = 0; r < world; ++r)
      if (!store.check({"joined/" + std::to_string(r)})) missing.push_back(r);
    throw TimeoutError(detail::cat("init_process_group: timed out after ", timeout.count(),
                                   " ms waiting for ranks to join: ", world - missing.size(), "/",
                                   world, " joined (missing ranks: ", detail::join(missing), ")"));
  }
}

// env://'s endpoint: MASTER_ADDR and MASTER_PORT, or under srun without
// them, the step's first node and a port from the job and step ids.
HostPort env_endpoint() {
  auto addr = env::get(env::kMasterAddr);
  std::string addr_from = env::kMasterAddr.name;
  if (!addr || addr->empty()) {
    addr = slurm::master_addr_from_slurm();
    addr_from = env::get(env::kSlurmStepNodelist) ? "SLURM_STEP_NODELIST's first node"
                                                  : "SLURM_JOB_NODELIST's first node";
  }
  DTRAIN_CHECK_ARG(addr && !addr->empty(),
                   "init_method env:// needs MASTER_ADDR (the host of rank 0), which is unset");
  HostPort hp;
  hp.host = *addr;
  if (auto port = env::get(env::kMasterPort)) {
    hp.port = net::parse_port(*port, env::kMasterPort.name);
  } else {
    auto derived = slurm::master_port_from_slurm();
    DTRAIN_CHECK_ARG(derived, "init_method env:// needs MASTER_PORT, which is unset");
    hp.port = static_cast<uint16_t>(*derived);
  }
  if (addr_from != env::kMasterAddr.name) {
    // A Slurm node name need not be in DNS: Slurm knows its address.
    try {
      net::check_resolves(hp.host, addr_from);
    } catch (const InvalidArgument&) {
      auto known = slurm::node_addr(hp.host);
      if (!known) throw;
      hp.host = *known;
    }
  }
  net::check_resolves(hp.host, addr_from);
  return hp;
}

}  // namespace

Rendezvous resolve_rendezvous_inputs(const InitOptions& options) {
  Rendezvous r;
  r.world_size = resolve_int(options.world_size(), "world_size",
                             {&env::kWorldSize, &env::kOmpiSize, &env::kSlurmNTasks}, 1, INT_MAX);
  r.rank = resolve_int(options.rank(), "rank", {&env::kRank, &env::kOmpiRank, &env::kSlurmProcId},
                       0, INT_MAX);
  DTRAIN_CHECK_ARG(r.rank < r.world_size, "rank ", r.rank, " is out of range for world size ",
                   r.world_size, " (expected 0..", r.world_size - 1,
                   "); check RANK and WORLD_SIZE");
  r.timeout = resolve_timeout(options);
  return r;
}

std::chrono::milliseconds resolve_timeout(const InitOptions& options) {
  if (options.timeout()) {
    DTRAIN_CHECK_ARG(options.timeout()->count() > 0, "InitOptions::timeout must be positive, got ",
                     options.timeout()->count(), " ms");
    return *options.timeout();
  }
  return std::chrono::seconds(*env::get_int(env::kTimeout, 1, 365LL * 24 * 3600));
}

Rendezvous rendezvous(const InitOptions& options) {
  Rendezvous r = resolve_rendezvous_inputs(options);
  const std::string& method = options.init_method();
  std::shared_ptr<Store> base;
  std::string master_host;
  bool hosts_store = false;
  if (options.store()) {
    base = options.store();
  } else if (method == "env://" || method.rfind("tcp://", 0) == 0) {
    HostPort hp;
    if (method == "env://") {
      hp = env_endpoint();
    } else {
      hp = parse_tcp_url(method);
      net::check_resolves(hp.host, "init_method '" + method + "' host");
    }
    master_host = hp.host;
    const bool agent = method == "env://" && truthy(env::get(env::kUseAgentStore).value_or(""));
    hosts_store = !agent && r.rank == 0;
    if (agent && env::get(env::kLauncher).value_or("") == "dtrain-run") {
      // dtrain-run's store speaks dtrain's protocol too, which can prove a
      // job token (PyTorch's c10d protocol cannot).
      base = std::make_shared<TcpStore>(
          TcpStoreOptions().host(hp.host).port(hp.port).timeout(r.timeout));
    } else if (agent) {
      if (store_auth::token_from_environment())
        log_warning(detail::cat("the launcher's agent store ", net::endpoint(hp.host, hp.port),
                                " speaks PyTorch's c10d protocol, which cannot check a job "
                                "token: DTRAIN_STORE_TOKEN is not used for it, and it is open "
                                "to anyone who can reach it (docs/security.md)"));
      base = connect_agent_store(hp.host, hp.port, r.timeout);
    } else {
      base = std::make_shared<TcpStore>(TcpStoreOptions()
                                            .host(hp.host)
                                            .port(hp.port)
                                            .is_server(r.rank == 0)
                                            .timeout(r.timeout));
    }
  } else if (method.rfind("file://", 0) == 0) {
    const std::string path = method.substr(7);
    DTRAIN_CHECK_ARG(!path.empty() && path[0] == '/', "init_method '", method,
                     "' is malformed (expected file:///absolute/path)");
    base = std::make_shared<FileStore>(path, r.timeout);
  } else {
    throw InvalidArgument(detail::cat("init_method '", method,
                                      "' is not supported (expected env://, tcp://host:port or "
                                      "file:///path)"));
  }
  base->set_timeout(r.timeout);
  r.local_address = address_from_environment(master_host);
  // Scope keys by restart attempt: torchrun's agent store outlives attempts.
  const auto attempt = env::get_int(env::kRestartCount, 0, INT_MAX).value_or(0);
  r.store = std::make_shared<PrefixStore>("dtrain/" + std::to_string(attempt), base);
  std::optional<LocalAddressFinder> finder;
  if (r.local_address.empty()) finder.emplace(*r.store, r.rank, r.timeout);
  join_barrier(*r.store, r.rank, r.world_size, r.timeout, hosts_store);
  if (finder) r.local_address = finder->finish();
  DTRAIN_LOG_INFO("init_process_group: rank ", r.rank, "/", r.world_size, " joined via ",
                  options.store() ? "user store" : method, ", local address ", r.local_address);
  return r;
}

}  // namespace dtrain
