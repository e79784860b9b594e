#pragma once

// Where a group's ranks are, and so how each pair is joined (no torch
// here): ranks on one host (shm/node.h: same kernel, network namespace and
// /dev/shm) reach each other through shared memory, the others through
// TCP. Every rank of a group computes the same Topology from the same
// store keys.

#include <string>
#include <vector>

#include "dtrain/store/store.h"

namespace dtrain::transport {

struct Topology {
  // Group ranks of each host, hosts in order of their lowest rank, ranks
  // ascending within a host.
  std::vector<std::vector<int>> hosts;
  std::vector<int> host_of;      // [rank]: index into hosts
  std::vector<int> local_index;  // [rank]: its place in hosts[host_of[rank]]

  explicit Topology(std::vector<std::vector<int>> hosts = {});
  // Every rank a host of its own (backend tcp: no pair shares memory), and
  // every rank on one host (backend shm).
  static Topology host_per_rank(int size);
  static Topology one_host(int size);
  int size() const { return static_cast<int>(host_of.size()); }
  bool same_host(int a, int b) const { return host_of[a] == host_of[b]; }
  // Every host holds the same number of ranks.
  bool uniform() const;
  // "2 hosts (ranks 0,1 | ranks 2,3)".
  std::string describe() const;
};

// Publishes this rank's host identity under "topology/host/<rank>" and reads
// every rank's (blocking, under the store's timeout): give it a store scoped
// to the group.
Topology discover_topology(Store& store, int rank, int size);

}  // namespace dtrain::transport
