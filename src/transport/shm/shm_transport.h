#pragma once

// The shm transport: the same frame protocol and engine as the TCP
// transport (engine/engine.h: eager credit, then rendezvous; each
// request completes on its own; one failure breaks the transport), carried
// by byte rings in one shared-memory segment per group between the ranks
// of one machine (ring_link.h) instead of sockets. It follows the contract
// in transport.h; a peer that dies is noticed within about 0.1 s.

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "dtrain/store/store.h"
#include "transport/transport.h"

namespace dtrain::transport {

struct ShmOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // setup
  std::string name;  // the group's name, for messages
  // As TcpOptions::unexpected_bytes: held for early messages, at most.
  size_t unexpected_bytes = size_t{64} << 20;
  // With the copy-free slots for collectives (Transport::shared_slots(),
  // shm/slots.h), in a segment of their own.
  bool slots = false;
};

// Every rank of `size` must be on this machine (else BackendUnavailable on
// every rank). Uses the store's keys under "shm/" and "slots/": give it a
// PrefixStore of its own.
std::unique_ptr<Transport> connect_shm(Store& store, int rank, int size,
                                       const ShmOptions& options);

// The bytes of each ring in a group of `size` ranks: 32 MiB over the
// group's rings, a power of two from 16 KiB to 1 MiB.
size_t shm_ring_bytes(int size);

}  // namespace dtrain::transport
