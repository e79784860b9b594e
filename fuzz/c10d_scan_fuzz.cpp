// libFuzzer harness: the TCP store server's scan of PyTorch c10d requests
// (store/c10d_wire.h), fed in pieces as a socket delivers them. The first
// input byte picks the dialect (bit 0: v1 or v2) and the piece size (the
// rest: 1 to 128 bytes); the other bytes are one connection's stream.
//
// Scanned piece by piece with one Scan state, a request must come out
// exactly as when its bytes are scanned at once: the same size, or the
// same refusal, or (cut short) the same size still needed; every partial
// answer must ask for more than it has; and a complete request's bytes,
// scanned alone, must give its size again. A crash, a sanitizer report or
// a broken rule (abort) fails the run.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "store/c10d_wire.h"

namespace {

namespace cw = dtrain::c10d_wire;

// One scan's outcome: a size, a need, or a refusal's text.
struct Outcome {
  size_t size = 0;
  size_t need = 0;
  std::optional<std::string> refused;
  bool operator==(const Outcome& o) const {
    return size == o.size && (size != 0 || need == o.need) && refused == o.refused;
  }
};

Outcome scan(cw::Dialect d, const uint8_t* p, size_t n, cw::Scan& s) {
  Outcome out;
  try {
    out.size = cw::scan(d, p, n, s, &out.need);
  } catch (const dtrain::wire::Malformed& m) {
    out.refused = m.what;
  }
  return out;
}

[[noreturn]] void broken(const char* rule) {
  std::fprintf(stderr, "c10d_scan_fuzz: %s\n", rule);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const cw::Dialect d = data[0] & 1 ? cw::Dialect::kC10dV1 : cw::Dialect::kC10dV2;
  const size_t piece = 1 + (data[0] >> 1);
  const uint8_t* p = data + 1;
  const size_t n = size - 1;
  size_t at = 0;  // where the request being scanned starts
  while (at < n) {
    cw::Scan whole_state;
    const Outcome whole = scan(d, p + at, n - at, whole_state);
    cw::Scan s;
    Outcome chunked;
    for (size_t have = std::min(piece, n - at);;) {
      chunked = scan(d, p + at, have, s);
      if (chunked.refused || chunked.size) break;
      if (chunked.need <= have) broken("a partial scan asked for no more bytes than it had");
      if (have == n - at) break;
      // The next piece, or straight to what the scan needs (as the server
      // reads a large value in one go).
      have = std::min(std::max(have + piece, chunked.need), n - at);
    }
    if (!(chunked == whole)) broken("a request scanned in pieces differs from one scanned at once");
    if (whole.refused || whole.size == 0) break;
    if (whole.size > n - at) broken("a scan reported a request longer than its bytes");
    cw::Scan again;
    if (scan(d, p + at, whole.size, again).size != whole.size)
      broken("a complete request, scanned alone, has another size");
    at += whole.size;
  }
  return 0;
}
