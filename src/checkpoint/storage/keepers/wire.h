#pragma once

// The protocol between a worker and the snapshot keeper of its host
// (keeper.h), over a Unix socket; torch-free. One request and
// one reply per connection. All integers little-endian.
//
//   request: "DTSN" | u32 op | i64 step | u32 rank | u32 world | u32 g | u64 n
//            | g bytes of group key | n payload bytes
//   reply:   u32 status (0 ok, 1 refused) | u64 n | n bytes (the answer, or why refused)
//
// The group key names the group whose snapshot a request is about (its
// name and ranks: keepers.cpp), so that groups sharing a host's keeper
// keep their snapshots apart. Both ends check what they read before
// allocating for it: a payload over the reader's limit is refused without
// being read. The keeper bounds a stall, not a transfer: each chunk of a
// request or reply must move within kStall.

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::snapshot_wire {

using Clock = std::chrono::steady_clock;

enum class Op : uint32_t {
  Put = 1,     // payload: rank's part of the snapshot of `step`
  Commit = 2,  // the snapshot of `step` is complete on every rank's keepers
  List = 3,    // answer: encode_listing
  Get = 4,     // answer: rank's part of the complete snapshot of `step`
};
inline constexpr uint32_t kLastOp = 4;
inline constexpr uint32_t kMaxWorld = 1u << 20;
inline constexpr uint32_t kMaxGroupKey = 2048;
// The keeper's bound on a stalled peer: every chunk (at most kChunk bytes)
// of a request or reply moves within it, however long the whole takes.
inline constexpr auto kStall = std::chrono::seconds(60);
inline constexpr size_t kChunk = size_t{4} << 20;

struct Request {
  Op op = Op::List;
  int64_t step = 0;
  uint32_t rank = 0, world = 0;
  std::string payload;
  std::string group;  // the group key
};

// A request's fixed part and group key, read before its payload.
struct Head {
  Op op = Op::List;
  int64_t step = 0;
  uint32_t rank = 0, world = 0;
  std::string group;
  uint64_t payload_bytes = 0;
};

// What a keeper holds: its complete snapshot (step -1: none) and the size
// of each rank's part of it that it keeps; and the same of the snapshot
// being written. Once any keeper has committed a step, every part of it
// was kept everywhere (the writers agree on that before they commit), so
// the parts of that step that a keeper holds uncommitted (its host's ranks
// were stopped between the agreement and their commit) serve a restore too.
struct Listing {
  uint64_t keeper = 0;  // a random id of the keeper: which ranks share one
  int64_t step = -1;
  uint32_t world = 0;
  std::vector<std::pair<uint32_t, uint64_t>> parts;  // (rank, bytes), by rank
  int64_t writing_step = -1;
  uint32_t writing_world = 0;
  std::vector<std::pair<uint32_t, uint64_t>> writing_parts;
};
std::string encode_listing(const Listing& listing);
// InvalidArgument "<what>: <problem>" when the bytes are not a listing.
Listing decode_listing(const std::string& bytes, const std::string& what);

// The worker's side: connects to `socket_path`, sends, returns the answer;
// a refusal throws dtrain::Error "<context>: <keeper's reason>", a keeper
// that cannot be reached or goes silent dtrain::NetworkError/TimeoutError
// naming the socket; an answer over `max_answer` bytes is refused unread
// (InvalidArgument).
std::string call(const std::string& socket_path, const Request& request, uint64_t max_answer,
                 Clock::time_point deadline, const std::string& context);

// The keeper's side. read_head throws InvalidArgument for a malformed
// request (bad magic, unknown op, rank not below world, a group key over
// kMaxGroupKey, a payload on an operation without one), each chunk under
// kStall; read_payload reads the payload the head announced.
// read_request is both, refusing a payload over `max_payload` unread.
Head read_head(int fd);
Request read_payload(int fd, Head head);
Request read_request(int fd, uint64_t max_payload);
void write_reply(int fd, bool ok, const std::string& body);

}  // namespace dtrain::snapshot_wire
