#include "ranks.h"

#include <unistd.h>

#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace dtrain::bench {

ShapedLink::ShapedLink(const std::string& rate, int per_host) : per_host_(per_host) {
  const auto id = std::to_string(getpid());
  ns_ = {"dtb-a-" + id, "dtb-b-" + id};
  const std::string va = ("dtba" + id).substr(0, 15), vb = ("dtbb" + id).substr(0, 15);
  dev_ = va;
  std::ostringstream sh;
  sh << "set -e; ip netns add " << ns_[0] << "; ip netns add " << ns_[1]
     << "; ip link add " << va << " type veth peer name " << vb
     << "; ip link set " << va << " netns " << ns_[0] << "; ip link set " << vb << " netns " << ns_[1]
     << "; ip -n " << ns_[0] << " addr add 10.215.0.1/24 dev " << va
     << "; ip -n " << ns_[1] << " addr add 10.215.0.2/24 dev " << vb;
  for (int i = 0; i < 2; ++i) {
    const auto& dev = i == 0 ? va : vb;
    sh << "; ip -n " << ns_[i] << " link set lo up; ip -n " << ns_[i] << " link set " << dev
       << " up; ip netns exec " << ns_[i] << " tc qdisc add dev " << dev << " root tbf rate "
       << rate << " burst 2mb latency 100ms";
  }
  if (std::system(("sh -c '" + sh.str() + "'").c_str()) != 0) {
    cleanup();
    throw std::runtime_error("--link-rate needs root and iproute2 (ip netns, tc)");
  }
}

ShapedLink::~ShapedLink() { cleanup(); }

int64_t ShapedLink::bytes() const {
  int64_t total = 0;
  for (const char* way : {"tx_bytes", "rx_bytes"})
    total += std::stoll(capture("ip netns exec " + ns_[0] + " cat /sys/class/net/" + dev_ +
                                "/statistics/" + way));
  return total;
}

void ShapedLink::cleanup() {
  for (const auto& n : ns_) std::system(("ip netns del " + n + " 2>/dev/null").c_str());
}

std::string run_ranks(int world, const std::string& mode, const Args& a, const ShapedLink* link,
                      const std::string& env) {
  static int port = 29810;
  port = port >= 29890 ? 29810 : port + 1;
  std::ostringstream cmd;
  const std::string exe = self_path();
  std::string rest = " rank " + mode;
  for (const auto& [k, v] : a.flags) rest += " --" + k + " " + v;
  const std::string master = link ? "10.215.0.1" : "127.0.0.1";
  for (int r = world - 1; r >= 0; --r) {
    if (link) cmd << "ip netns exec " << link->ns(r) << " env ";
    cmd << "RANK=" << r << " WORLD_SIZE=" << world << " MASTER_ADDR=" << master
        << " MASTER_PORT=" << port << " OMP_NUM_THREADS=1 " << env << " " << exe << rest
        << (r > 0 ? " >/dev/null & " : "; wait");
  }
  return capture("sh -c '" + cmd.str() + "'");
}

}  // namespace dtrain::bench
