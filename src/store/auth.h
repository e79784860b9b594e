#pragma once

// The job token that guards a TCP store (docs/security.md): every
// connection proves it holds the token before anything else is served, by
// HMAC-SHA256 challenge and response (OpenSSL's libcrypto), both ways:
//   client -> AUTH_HELLO  client nonce (32 random bytes)
//   server -> OK          server nonce, HMAC(token, 'S' | client nonce | server nonce)
//   client -> AUTH_PROOF  HMAC(token, 'C' | server nonce | client nonce)
//   server -> OK          (or closes the connection)
// The token itself never crosses the wire and never appears in a message.

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace dtrain::store_auth {

constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kMaxTokenBytes = 4096;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

// The job's token: DTRAIN_STORE_TOKEN, or the content of the file named by
// DTRAIN_STORE_TOKEN_FILE (trailing newlines dropped; the file must not be
// readable by group or others). nullopt when neither is set. Throws
// InvalidArgument naming the variable (never the token) when both are set,
// the file is unsafe or unreadable, or the token is empty or over 4 KiB.
std::optional<std::string> token_from_environment();

Nonce random_nonce();

// HMAC-SHA256 keyed by the token over `role` (S: server, C: client) and the
// two nonces in the given order.
Proof proof(const std::string& token, char role, const Nonce& first, const Nonce& second);

// Constant-time comparison of a received proof of `n` bytes with `want`.
bool matches(const Proof& want, const uint8_t* got, size_t n);

// 32 random bytes as 64 hex digits: a fresh token (dtrain-run --standalone).
std::string fresh_token();

}  // namespace dtrain::store_auth
