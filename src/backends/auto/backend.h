#pragma once

// Backend "auto": the fastest correct path between each pair of ranks.
//
// create_auto_group() finds where the ranks are (transport/topology.h).
//  - All on one host: an shm group (its collectives in one shared segment,
//    its send/recv over shared-memory rings).
//  - Over several hosts: the fabric's group (backends/fabric/backend.h) over
//    the discovered topology: the ranks of a host joined by shared-memory
//    rings and the host's slots, the others by TCP (transport/fabric.h):
//    one mesh, one executor, one sequence number and one flight-recorder
//    entry per collective. Its algorithms see the topology: all_reduce,
//    all_gather and reduce_scatter above 64 KiB run in two levels where
//    every host has as many ranks (algorithms/two_level.cpp), their phases
//    inside a host in its shared memory; the rest run as on tcp.
//  - DTRAIN_SHM_DISABLE=1: tcp for every rank.
// Where libtorch has CUDA, CUDA tensors are routed to nccl or staged through
// host memory (device_routing.h).

#include <memory>

#include "dtrain/process_group.h"
#include "dtrain/store/store.h"

namespace dtrain::auto_backend {

std::shared_ptr<ProcessGroup> create_auto_group(std::shared_ptr<Store> store, int rank, int size,
                                                const GroupOptions& options);

}  // namespace dtrain::auto_backend
