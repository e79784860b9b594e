#pragma once

// The protocol between a worker and the snapshot keeper of its host
// (snapshot_keeper.h), over a Unix socket; torch-free. One request and
// one reply per connection. All integers little-endian.
//
//   request: "DTSN" | u32 op | i64 step | u32 rank | u32 world | u64 n | n payload bytes
//   reply:   u32 status (0 ok, 1 refused) | u64 n | n bytes (the answer, or why refused)
//
// Both ends check what they read before allocating for it: a payload over
// the reader's limit is refused without being read.

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

struct Request {
  Op op = Op::List;
  int64_t step = 0;
  uint32_t rank = 0, world = 0;
  std::string payload;
};

// What a keeper holds: its complete snapshot (step -1: none) and the size
// of each rank's part of it that it keeps.
struct Listing {
  uint64_t keeper = 0;  // a random id of the keeper: which ranks share one
  int64_t step = -1;
  uint32_t world = 0;
  std::vector<std::pair<uint32_t, uint64_t>> parts;  // (rank, bytes), by rank
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

// The keeper's side. read_request throws InvalidArgument for a malformed
// request (bad magic, unknown op, rank not below world, a payload over
// `max_payload` bytes: not read).
Request read_request(int fd, uint64_t max_payload, Clock::time_point deadline);
void write_reply(int fd, bool ok, const std::string& body, Clock::time_point deadline);

}  // namespace dtrain::snapshot_wire
