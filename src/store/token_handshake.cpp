#include "store/token_handshake.h"

#include <algorithm>

#include "common/enforce.h"

namespace dtrain::store_detail {

HandshakeStep handshake_step(StoreConnection& c, const std::string& token, const wire::Header& h,
                             wire::Reader& r) {
  namespace auth = store_auth;
  HandshakeStep step;
  if (h.opcode == wire::kAuthHello && !c.challenged) {
    const auto nonce = r.bytes();
    r.expect_end();
    if (nonce.size() != auth::kNonceBytes) throw wire::Malformed{"AUTH_HELLO nonce is not 32 bytes"};
    std::copy(nonce.begin(), nonce.end(), c.client_nonce.begin());
    c.server_nonce = auth::random_nonce();
    c.challenged = true;
    const auto mine = auth::proof(token, 'S', c.client_nonce, c.server_nonce);
    step.reply = wire::Writer(wire::kOk, h.request_id)
                     .bytes(c.server_nonce.data(), c.server_nonce.size())
                     .bytes(mine.data(), mine.size())
                     .finish();
    return step;
  }
  if (h.opcode == wire::kAuthProof && c.challenged) {
    const auto got = r.bytes();
    r.expect_end();
    const auto want = auth::proof(token, 'C', c.server_nonce, c.client_nonce);
    if (!auth::matches(want, got.data(), got.size())) {
      step.refusal = "wrong job token";
      step.told = "wrong job token: its proof does not match this store's token";
      return step;
    }
    c.authenticated = true;
    step.reply = wire::Writer(wire::kOk, h.request_id).finish();
    return step;
  }
  step.refusal = detail::cat("sent ", wire::op_name(h.opcode), " before proving the job token");
  return step;
}

std::string pre_auth_problem(const StoreConnection& c, const wire::Header& h) {
  const uint16_t expected = c.challenged ? wire::kAuthProof : wire::kAuthHello;
  if (h.opcode != expected)
    return detail::cat("sent ", wire::op_name(h.opcode), " (", h.length,
                       " bytes) before proving the job token");
  const size_t most = 4 + (c.challenged ? store_auth::kProofBytes : store_auth::kNonceBytes);
  if (h.length > most)
    return detail::cat("declared an ", wire::op_name(h.opcode), " of ", h.length,
                       " bytes (the handshake's are at most ", most, ")");
  return {};
}

}  // namespace dtrain::store_detail
