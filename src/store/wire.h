#pragma once

// The TCP store's wire protocol, shared by server and client
// (docs/design/store-protocol.md has the full description).
//
// Every frame, request or reply, is a 16-byte header followed by a payload:
//   u32 magic "DTRS" | u16 version | u16 opcode | u32 payload length | u32 request id
// All integers are little-endian. Payload fields are u32 / i64 integers and
// byte strings written as a u32 length followed by the bytes.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dtrain/store/tcp_store.h"

namespace dtrain::wire {

constexpr uint32_t kMagic = 0x53525444;  // the bytes "DTRS" read as a little-endian u32
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 16;
constexpr uint32_t kMaxKeyBytes = 64 * 1024;
constexpr uint32_t kMaxPayloadBytes = TcpStore::kMaxFrameBytes;

// Request opcodes. Payloads (s = byte string, [..] = u32 count then items):
enum Op : uint16_t {
  kSet = 1,         // s key, s value                 -> OK
  kGet = 2,         // s key, u32 timeout_ms           -> OK s value | TIMEOUT
  kAdd = 3,         // s key, i64 delta                -> OK i64 sum
  kCompareSet = 4,  // s key, s expected, s desired    -> OK s value now stored
  kCheck = 5,       // [s keys]                        -> OK u32 (0|1)
  kDelete = 6,      // s key                           -> OK u32 (0|1)
  kNumKeys = 7,     // (empty)                         -> OK i64
  kWait = 8,        // u32 timeout_ms, [s keys]        -> OK | TIMEOUT
  kAuthHello = 9,   // s client nonce                  -> OK s server nonce, s server proof
  kAuthProof = 10,  // s client proof                  -> OK (wrong: connection closed)
  kSetEphemeral = 11,  // s key, s value              -> OK; the key is deleted when this connection closes
  kLastOp = kSetEphemeral,
};

// Reply opcodes. An ERROR payload is one string: the message of the
// InvalidArgument the client throws (e.g. add() on a non-integer value).
// REFUSED (request id 0, or that of the request refused) is the last frame
// of a connection the server closes, one string saying why (no job token
// proved, the connection limit, no request in time); the client throws it
// as a NetworkError.
enum Status : uint16_t { kOk = 0x100, kTimeout = 0x101, kError = 0x102, kRefused = 0x103 };

inline const char* op_name(uint16_t op) {
  static const char* names[] = {"?",     "SET",    "GET",      "ADD",  "COMPARE_SET", "CHECK",
                                "DELETE", "NUM_KEYS", "WAIT", "AUTH_HELLO", "AUTH_PROOF",
                                "SET_EPHEMERAL"};
  return op <= kLastOp ? names[op] : "?";
}

struct Header {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t opcode = 0;
  uint32_t length = 0;
  uint32_t request_id = 0;
};

inline uint32_t get_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
inline uint16_t get_u16(const uint8_t* p) { return uint16_t(p[0] | p[1] << 8); }

inline Header decode_header(const uint8_t* p) {
  Header h;
  h.magic = get_u32(p);
  h.version = get_u16(p + 4);
  h.opcode = get_u16(p + 6);
  h.length = get_u32(p + 8);
  h.request_id = get_u32(p + 12);
  return h;
}

// Why a header must be refused, or nullptr when it is acceptable. Checked
// before anything is allocated for the payload.
inline const char* header_problem(const Header& h, bool is_request) {
  if (h.magic != kMagic) return "bad magic";
  if (h.version != kVersion) return "unsupported protocol version";
  const bool known = is_request ? (h.opcode >= kSet && h.opcode <= kLastOp)
                                : (h.opcode >= kOk && h.opcode <= kRefused);
  if (!known) return "unknown opcode";
  if (h.length > kMaxPayloadBytes) return "declared payload length over the 64 MiB limit";
  return nullptr;
}

// Builds one frame; the header's length is filled in by finish().
class Writer {
 public:
  Writer(uint16_t opcode, uint32_t request_id) : buf_(kHeaderBytes) {
    put32(0, kMagic);
    put16(4, kVersion);
    put16(6, opcode);
    put32(12, request_id);
  }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Writer& i64(int64_t v) {
    const auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<uint8_t>(u >> (8 * i)));
    return *this;
  }
  Writer& bytes(const void* data, size_t n) {
    u32(static_cast<uint32_t>(n));
    const auto* p = static_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + n);
    return *this;
  }
  Writer& str(const std::string& s) { return bytes(s.data(), s.size()); }
  Writer& bytes(const std::vector<uint8_t>& v) { return bytes(v.data(), v.size()); }
  size_t payload_size() const { return buf_.size() - kHeaderBytes; }
  // `trailing`: bytes the caller sends right after this frame's bytes as
  // the end of its payload (a stored value, not copied into the frame).
  std::vector<uint8_t> finish(size_t trailing = 0) {
    put32(8, static_cast<uint32_t>(payload_size() + trailing));
    return std::move(buf_);
  }

 private:
  void put16(size_t at, uint16_t v) {
    buf_[at] = uint8_t(v);
    buf_[at + 1] = uint8_t(v >> 8);
  }
  void put32(size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) buf_[at + i] = static_cast<uint8_t>(v >> (8 * i));
  }
  std::vector<uint8_t> buf_;
};

// A payload field whose length runs past the end of its frame.
struct Malformed {
  const char* what;
};

// Reads the fields of one payload; throws Malformed instead of reading past
// the frame, so a hostile length never causes a large allocation or a read
// out of bounds.
class Reader {
 public:
  Reader(const uint8_t* data, size_t n) : p_(data), left_(n) {}
  uint32_t u32() {
    need(4, "truncated integer");
    const uint32_t v = get_u32(p_);
    skip(4);
    return v;
  }
  int64_t i64() {
    need(8, "truncated integer");
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(p_[i]) << (8 * i);
    skip(8);
    return static_cast<int64_t>(v);
  }
  std::vector<uint8_t> bytes() {
    const uint32_t n = u32();
    need(n, "string length runs past the end of the frame");
    std::vector<uint8_t> v(p_, p_ + n);
    skip(n);
    return v;
  }
  std::string str() {
    auto v = bytes();
    return std::string(v.begin(), v.end());
  }
  // A count of items that each take at least min_item_bytes: bounded by what
  // is left, so `reserve(count)` is safe.
  uint32_t count(size_t min_item_bytes) {
    const uint32_t n = u32();
    if (n > left_ / min_item_bytes) throw Malformed{"item count runs past the end of the frame"};
    return n;
  }
  void expect_end() const {
    if (left_ != 0) throw Malformed{"trailing bytes after the payload"};
  }

 private:
  void need(size_t n, const char* why) const {
    if (n > left_) throw Malformed{why};
  }
  void skip(size_t n) {
    p_ += n;
    left_ -= n;
  }
  const uint8_t* p_;
  size_t left_;
};

}  // namespace dtrain::wire
