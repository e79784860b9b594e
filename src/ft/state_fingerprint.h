#pragma once

// The fingerprint of a state's layout that replicas compare at the
// lighthouse: every entry's name, kind, dtype and shape (and a sharded
// piece's place in its whole), hashed (64-bit FNV-1a, 16 hex digits).
// Values do not enter it.

#include <string>

#include "dtrain/checkpoint/distributed.h"

namespace dtrain::ft {

std::string state_fingerprint(const checkpoint::DistributedState& state);

}  // namespace dtrain::ft
