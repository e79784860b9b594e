#include "world/local_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <optional>

#include "common/decimal.h"
#include "common/enforce.h"
#include "transport/shm/node.h"
#include "common/socket.h"

namespace dtrain {
namespace {

constexpr const char* kHostKey = "local_address/rank0";
constexpr const char* kRemoteKey = "local_address/remote";

// An address as raw bytes (4 or 16), parsed from "addr" or "addr/len".
struct Net {
  int family = AF_UNSPEC;
  unsigned char bytes[16] = {};
  int prefix = -1;  // -1: no length given
  std::string text;  // the address without the length
};

std::optional<Net> parse_net(const std::string& s) {
  Net n;
  const auto slash = s.find('/');
  n.text = s.substr(0, slash);
  if (slash != std::string::npos) {
    const auto prefix = detail::parse_decimal(s.substr(slash + 1));
    if (!prefix || *prefix > 128) return std::nullopt;
    n.prefix = static_cast<int>(*prefix);
  }
  if (inet_pton(AF_INET, n.text.c_str(), n.bytes) == 1) {
    n.family = AF_INET;
  } else if (inet_pton(AF_INET6, n.text.c_str(), n.bytes) == 1) {
    n.family = AF_INET6;
  } else {
    return std::nullopt;
  }
  const int bits = n.family == AF_INET ? 32 : 128;
  if (n.prefix < -1 || n.prefix > bits) return std::nullopt;
  return n;
}

bool same_subnet(const Net& mine, const Net& theirs) {
  if (mine.family != theirs.family || mine.prefix < 0) return false;
  const int full = mine.prefix / 8, rest = mine.prefix % 8;
  if (std::memcmp(mine.bytes, theirs.bytes, static_cast<size_t>(full)) != 0) return false;
  if (rest == 0) return true;
  const unsigned char mask = static_cast<unsigned char>(0xff << (8 - rest));
  return (mine.bytes[full] & mask) == (theirs.bytes[full] & mask);
}

int prefix_length(const sockaddr* mask, int family) {
  if (mask == nullptr) return family == AF_INET ? 32 : 128;
  const unsigned char* p =
      family == AF_INET
          ? reinterpret_cast<const unsigned char*>(&reinterpret_cast<const sockaddr_in*>(mask)->sin_addr)
          : reinterpret_cast<const unsigned char*>(&reinterpret_cast<const sockaddr_in6*>(mask)->sin6_addr);
  int len = 0;
  for (int i = 0; i < (family == AF_INET ? 4 : 16); ++i) len += __builtin_popcount(p[i]);
  return len;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < s.size()) {
    const auto end = s.find('\n', start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

}  // namespace

std::vector<std::string> interface_networks() {
  ifaddrs* raw = nullptr;
  if (getifaddrs(&raw) != 0) return {};
  std::unique_ptr<ifaddrs, decltype(&freeifaddrs)> list(raw, &freeifaddrs);
  std::vector<std::string> v4, v6;
  for (const ifaddrs* ifa = list.get(); ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || !(ifa->ifa_flags & IFF_UP) || (ifa->ifa_flags & IFF_LOOPBACK))
      continue;
    const int family = ifa->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (family == AF_INET6 &&
        IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(ifa->ifa_addr)->sin6_addr))
      continue;
    char host[NI_MAXHOST];
    const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (getnameinfo(ifa->ifa_addr, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0)
      continue;
    (family == AF_INET ? v4 : v6)
        .push_back(detail::cat(host, "/", prefix_length(ifa->ifa_netmask, family)));
  }
  v4.insert(v4.end(), v6.begin(), v6.end());
  return v4;
}

std::string address_facing(const std::vector<std::string>& theirs) {
  if (theirs.empty())
    throw NetworkError(
        "cannot choose a local address for the other ranks: the rank to reach has no "
        "non-loopback address (set DTRAIN_SOCKET_IFNAME to the interface to use)");
  std::vector<Net> mine;
  for (const auto& s : interface_networks())
    if (auto n = parse_net(s)) mine.push_back(*n);
  for (const auto& t : theirs) {
    const auto other = parse_net(t);
    if (!other) continue;
    for (const auto& m : mine)
      if (same_subnet(m, *other)) return m.text;
  }
  const auto first = parse_net(theirs.front());
  return net::local_address_towards(first ? first->text : theirs.front());
}

LocalAddressFinder::LocalAddressFinder(Store& store, int rank, std::chrono::milliseconds timeout)
    : store_(store) {
  // The one host identity (shm's: boot id, network namespace, /dev/shm):
  // equal keys can use loopback, and shared memory too.
  const std::string me = shm::node_key();
  if (rank == 0) {
    std::string value = me;
    for (const auto& n : interface_networks()) value += "\n" + n;
    store_.set(kHostKey, value);
    return;
  }
  try {
    store_.wait({kHostKey}, timeout);
  } catch (const TimeoutError&) {
    throw TimeoutError(detail::cat("init_process_group: timed out after ", timeout.count(),
                                   " ms waiting for ranks to join: rank 0 has not joined"));
  }
  const auto lines = split_lines(store_.get_string(kHostKey));
  if (!lines.empty() && lines.front() == me) return;  // on rank 0's host: decided in finish()
  address_ = address_facing({lines.begin() + (lines.empty() ? 0 : 1), lines.end()});
  store_.set(kRemoteKey, address_);
}

std::string LocalAddressFinder::finish() {
  if (!address_.empty()) return address_;
  if (!store_.check({kRemoteKey})) return "127.0.0.1";  // the whole job is on this host
  return address_facing({store_.get_string(kRemoteKey)});
}

}  // namespace dtrain
