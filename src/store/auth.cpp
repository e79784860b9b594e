#include "store/auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/enforce.h"
#include "common/env.h"

namespace dtrain::store_auth {

namespace {

std::string read_token_file(const std::string& path) {
  const char* var = env::kStoreTokenFile.name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK_ARG(fd >= 0, var, "='", path, "': cannot open it: ", std::strerror(errno));
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  std::string text;
  if (stat_ok && S_ISREG(st.st_mode) && (st.st_mode & 077) == 0) {
    char buf[kMaxTokenBytes + 2];
    ssize_t n = 0;
    while ((n = ::read(fd, buf, sizeof(buf))) > 0 && text.size() <= kMaxTokenBytes + 2)
      text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  DTRAIN_CHECK_ARG(stat_ok && S_ISREG(st.st_mode), var, "='", path, "' is not a regular file");
  DTRAIN_CHECK_ARG((st.st_mode & 077) == 0, var, "='", path, "' can be read by group or others (mode ",
                   std::to_string((st.st_mode >> 6) & 7) + std::to_string((st.st_mode >> 3) & 7) +
                       std::to_string(st.st_mode & 7),
                   "); a job token file must be private: chmod 600 '", path, "'");
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text;
}

}  // namespace

std::optional<std::string> token_from_environment() {
  const auto direct = env::get(env::kStoreToken);
  const auto file = env::get(env::kStoreTokenFile);
  if (!direct && !file) return std::nullopt;
  DTRAIN_CHECK_ARG(!(direct && file), "both ", env::kStoreToken.name, " and ",
                   env::kStoreTokenFile.name, " are set; set one of them");
  const std::string token = direct ? *direct : read_token_file(*file);
  const char* var = direct ? env::kStoreToken.name : env::kStoreTokenFile.name;
  DTRAIN_CHECK_ARG(!token.empty(), var, " gives an empty job token");
  DTRAIN_CHECK_ARG(token.size() <= kMaxTokenBytes, var, " gives a job token of ", token.size(),
                   " bytes, over the limit of ", kMaxTokenBytes);
  return token;
}

Nonce random_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    throw NetworkError("TCP store: the system's random number generator failed");
  return n;
}

Proof proof(const std::string& token, char role, const Nonce& first, const Nonce& second) {
  uint8_t msg[1 + 2 * kNonceBytes];
  msg[0] = static_cast<uint8_t>(role);
  std::memcpy(msg + 1, first.data(), kNonceBytes);
  std::memcpy(msg + 1 + kNonceBytes, second.data(), kNonceBytes);
  Proof out{};
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), msg, sizeof(msg),
            out.data(), &len) ||
      len != kProofBytes)
    throw NetworkError("TCP store: HMAC-SHA256 failed");
  return out;
}

bool matches(const Proof& want, const uint8_t* got, size_t n) {
  return n == want.size() && CRYPTO_memcmp(want.data(), got, n) == 0;
}

std::string fresh_token() {
  const Nonce bytes = random_nonce();
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

}  // namespace dtrain::store_auth
