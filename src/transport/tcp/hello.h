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
//
// Each hello also grants the other end eager credit on this connection (in
// KiB, see connection.h). An acceptor that refuses a joiner for a reason the
// joiner should report (another group, a token on one side only, a rank out
// of range) answers with a hello flagged kHelloRefused whose `eager_kib`
// holds the reason, then closes; one it merely drops (too many connections
// pending) closes without a word, and the joiner connects again.

#include <cstdint>

#include "store/auth.h"

namespace dtrain::transport::tcp {

constexpr uint32_t kHelloMagic = 0x69485464;  // "dTHi"
constexpr uint32_t kHelloVersion = 4;  // 4: announcements cost no credit
constexpr uint32_t kHelloHasToken = 1;  // flags
constexpr uint32_t kHelloRefused = 2;

// Why an acceptor refused a joiner (Hello::eager_kib of a refusal).
enum class Refusal : uint32_t {
  kAnotherGroup = 1,
  kOutOfRange = 2,
  kTokenOnJoinerOnly = 3,
  kTokenOnAcceptorOnly = 4,
};

struct Hello {
  uint32_t magic;
  uint32_t version;
  uint64_t group_id;
  uint32_t rank;
  uint32_t stream;
  uint32_t flags;
  uint32_t eager_kib;  // the credit granted; a refusal's reason
  store_auth::Nonce nonce;  // zero without a token
};
static_assert(sizeof(Hello) == 64, "the hello is 64 bytes on the wire");

constexpr char kAcceptorRole = 'a';
constexpr char kJoinerRole = 'j';

}  // namespace dtrain::transport::tcp
