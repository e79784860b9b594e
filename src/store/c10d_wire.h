#pragma once

// The wire format of PyTorch's c10d TCPStore, as its clients speak it, so
// that dtrain's TCP store server can stand in for torchrun's agent store
// (dtrain-run hosts one store on MASTER_PORT; PyTorch and dtrain workers
// both connect to it as clients). docs/design/store-protocol.md describes
// both dialects.
//
// A request is one query-type byte followed by its fields: integers in host
// byte order (little-endian on every platform dtrain builds for), strings
// and byte strings as a u64 length then the bytes, key lists as a u64 count
// then the keys. Two numberings exist:
//  - v1 (PyTorch 1.13 and 2.0): SET=0 ... DELETE_KEY=8, no handshake;
//  - v2 (PyTorch 2.2 and newer): every connection opens with VALIDATE
//    (0x00, then the u32 magic 0x3C85F7CE), and the numbers shift by one.
// Which one a client speaks is told by its first five bytes.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "store/wire.h"

namespace dtrain::c10d_wire {

constexpr uint32_t kValidateMagic = 0x3C85F7CE;
// Bounds a request is held to before anything is allocated for it (the
// same key and value limits as dtrain's own frames).
constexpr uint64_t kMaxKeyBytes = wire::kMaxKeyBytes;
constexpr uint64_t kMaxValueBytes = wire::kMaxPayloadBytes;
constexpr uint64_t kMaxKeysPerRequest = 128 * 1024;
// A whole request: one maximal value and key with their fields (a
// MULTI_SET or WAIT may carry several, within this total).
constexpr uint64_t kMaxRequestBytes = kMaxValueBytes + kMaxKeyBytes + 64;

enum class Dialect : uint8_t { kUnknown, kDtrain, kC10dV1, kC10dV2 };

// What the first bytes of a connection say; kUnknown while too few have
// arrived. Anything that is neither dialect is refused (`*refused`).
Dialect detect(const uint8_t* p, size_t n, bool* refused);

// Operations, whatever their number in the client's dialect.
enum class Op : uint8_t {
  kValidate, kSet, kCompareSet, kGet, kAdd, kCheck, kWait, kNumKeys, kDelete,
  kAppend, kMultiGet, kMultiSet, kCancelWait, kPing, kWatchKey, kQueuePush, kQueuePop,
  kQueueLen, kListKeys, kBarrier, kInvalid,
};
Op decode_op(Dialect d, uint8_t byte);
const char* op_name(Op op);

// Reply bytes.
constexpr uint8_t kCheckReady = 0, kCheckNotReady = 1;
constexpr uint8_t kStopWaiting = 0, kWaitCanceled = 1;

// Thrown while parsing: the request is not all there yet.
struct Incomplete {};

// How far the request at the front of a connection's buffer has been
// looked at, so that bytes arriving in small pieces are each scanned once
// (a 64 MiB MULTI_SET in 64 KiB reads is scanned once, not re-parsed from
// its first byte 1,024 times). Positions count from the query byte.
struct Scan {
  uint64_t pos = 0;         // bytes of the request accounted for so far
  uint8_t field = 0;        // next field of the request's layout
  uint64_t items_left = 0;  // of the key or key-value list being read
  bool in_list = false;
  bool value_next = false;  // in a key-value list: the pair's value comes next
};

// Scans the request at p[0, n) (bytes before s.pos are not looked at
// again). Returns the request's size once all of it is there (and resets
// `s`); else 0, with *need the size the buffer must reach before scanning
// again. Throws wire::Malformed for a length, count or request size over
// its bound, as soon as the field that declares it has arrived.
size_t scan(Dialect d, const uint8_t* p, size_t n, Scan& s, size_t* need);

// Reads one request's fields; throws Incomplete when the buffer ends first
// and wire::Malformed when a declared length is over its bound (checked
// before waiting for the bytes, so a hostile length never grows a buffer).
class Reader {
 public:
  Reader(const uint8_t* data, size_t n) : p_(data), left_(n) {}
  uint8_t u8() { return take<uint8_t>(); }
  uint32_t u32() { return take<uint32_t>(); }
  int64_t i64() { return take<int64_t>(); }
  std::vector<uint8_t> bytes(uint64_t limit, const char* what) {
    const uint64_t n = take<uint64_t>();
    if (n > limit) throw wire::Malformed{what};
    need(n);
    std::vector<uint8_t> v(p_, p_ + n);
    skip(n);
    return v;
  }
  std::string key() {
    auto v = bytes(kMaxKeyBytes, "key over the 64 KiB limit");
    return std::string(v.begin(), v.end());
  }
  std::vector<uint8_t> value() { return bytes(kMaxValueBytes, "value over the 64 MiB limit"); }
  uint64_t count() {
    const uint64_t n = take<uint64_t>();
    if (n > kMaxKeysPerRequest) throw wire::Malformed{"more than 131072 keys in one request"};
    return n;
  }
  std::vector<std::string> keys() {
    const uint64_t n = count();
    std::vector<std::string> out;
    out.reserve(n);
    for (uint64_t i = 0; i < n; ++i) out.push_back(key());
    return out;
  }
  size_t consumed(const uint8_t* start) const { return static_cast<size_t>(p_ - start); }

 private:
  template <typename T>
  T take() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    skip(sizeof(T));
    return v;
  }
  void need(uint64_t n) const {
    if (n > left_) throw Incomplete{};
  }
  void skip(size_t n) {
    p_ += n;
    left_ -= n;
  }
  const uint8_t* p_;
  size_t left_;
};

// Builds reply bytes.
class Writer {
 public:
  Writer& u8(uint8_t v) { return raw(&v, 1); }
  Writer& u32(uint32_t v) { return raw(&v, sizeof(v)); }
  Writer& i64(int64_t v) { return raw(&v, sizeof(v)); }
  Writer& u64(uint64_t v) { return raw(&v, sizeof(v)); }
  Writer& bytes(const std::vector<uint8_t>& v) {
    const uint64_t n = v.size();
    raw(&n, sizeof(n));
    return raw(v.data(), v.size());
  }
  Writer& str(const std::string& s) { return bytes(std::vector<uint8_t>(s.begin(), s.end())); }
  std::vector<uint8_t> take() { return std::move(buf_); }
  bool empty() const { return buf_.empty(); }

 private:
  Writer& raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
    return *this;
  }
  std::vector<uint8_t> buf_;
};

}  // namespace dtrain::c10d_wire
