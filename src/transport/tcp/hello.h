#pragma once

// The opening of every TCP transport connection (docs/security.md). The
// joining rank (the higher one, which connects) sends a Hello; the
// accepting rank checks it and answers with its own Hello. With a job
// token (DTRAIN_STORE_TOKEN), both hellos carry 32-byte random nonces and
// each side proves it holds the token, the acceptor first:
//   joiner   -> Hello (joiner nonce)
//   acceptor -> Hello (acceptor nonce), HMAC(token, 'a' | joiner nonce | acceptor nonce)
//   joiner   -> HMAC(token, 'j' | acceptor nonce | joiner nonce)
// The acceptor uses a connection only after the joiner's proof; the joiner
// only after the acceptor's. Roles 'a' and 'j' differ from the store's, so
// no proof from one exchange answers another.

#include <cstdint>

#include "store/auth.h"

namespace dtrain::transport::tcp {

constexpr uint32_t kHelloMagic = 0x69485464;  // "dTHi"
constexpr uint32_t kHelloVersion = 2;
constexpr uint32_t kHelloHasToken = 1;  // flags

struct Hello {
  uint32_t magic;
  uint32_t version;
  uint64_t group_id;
  uint32_t rank;
  uint32_t stream;
  uint32_t flags;
  uint32_t reserved;
  store_auth::Nonce nonce;  // zero without a token
};
static_assert(sizeof(Hello) == 64, "the hello is 64 bytes on the wire");

constexpr char kAcceptorRole = 'a';
constexpr char kJoinerRole = 'j';

}  // namespace dtrain::transport::tcp
