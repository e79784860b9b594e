#pragma once

// The job token's handshake on a connection to the TCP store (store/auth.h):
// AUTH_HELLO, then AUTH_PROOF, before anything else is served. Anything
// else, or a wrong proof, is refused: the connection is closed with
// nothing stored or revealed.

#include <cstdint>
#include <string>
#include <vector>

#include "store/store_connection.h"
#include "store/wire.h"

namespace dtrain::store_detail {

struct HandshakeStep {
  std::vector<uint8_t> reply;  // the frame to answer with, when accepted
  std::string refusal;         // why it is refused, for the log (empty: accepted)
  std::string told;            // what the client is told when refused (empty: nothing)
};

// The next frame of `c`'s handshake, `h` and its payload `r` (which throws
// wire::Malformed on a bad one).
HandshakeStep handshake_step(StoreConnection& c, const std::string& token, const wire::Header& h,
                             wire::Reader& r);

// Why a frame that arrives before the token is proved must be refused from
// its header alone (empty: it may be read). Only the next frame of the
// handshake is allowed, and no longer than that frame can be, so a
// stranger's declared 64 MiB is refused after 16 bytes instead of being
// buffered (256 pending connections would otherwise hold 16 GiB).
std::string pre_auth_problem(const StoreConnection& c, const wire::Header& h);

}  // namespace dtrain::store_detail
