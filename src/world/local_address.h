#pragma once

// Where peers reach this rank's sockets, when nothing names the network.
//
// env:// and tcp:// give a master host: the address that routes towards it
// is the one peers can reach. file:// and a user's own store give none, and
// this host's name is no answer (Debian maps it to 127.0.1.1), so the ranks
// find out through the store who shares a network namespace with whom:
//
//  1. before joining, rank 0 publishes its host identity (shm::node_key():
//     boot id, network namespace, /dev/shm) and its interface addresses; every other rank
//     reads them, and a rank on another host picks its own address on rank
//     0's subnet (else the one that routes towards rank 0) and publishes it
//     as "a remote rank is here";
//  2. after the join barrier every rank has published, so a rank on rank
//     0's host knows whether anyone is remote: if so it picks its address
//     towards that remote rank, else loopback.
//
// Each rank does O(1) store operations, whatever the world size.

#include <chrono>
#include <string>
#include <vector>

#include "dtrain/store/store.h"

namespace dtrain {

class LocalAddressFinder {
 public:
  // Step 1; call before the join barrier. `store` is scoped to the job.
  LocalAddressFinder(Store& store, int rank, std::chrono::milliseconds timeout);
  // Step 2; call after the join barrier.
  std::string finish();

 private:
  Store& store_;
  std::string address_;  // decided in step 1 (a remote rank), else empty
};

// This host's non-loopback addresses with their prefix lengths, as
// "addr/len" (IPv4 first, link-local IPv6 left out).
std::vector<std::string> interface_networks();

// Of our networks, the address on the same subnet as one of `theirs`
// ("addr/len" or plain addresses), else the address that routes towards the
// first of them. Throws NetworkError when `theirs` is empty.
std::string address_facing(const std::vector<std::string>& theirs);

}  // namespace dtrain
