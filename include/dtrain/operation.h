#pragma once

// What a process group runs, in the words that its front door
// (process_group.h) and its backends (backend.h) share: the reductions,
// the options that build a group, each operation as a descriptor (Op), and
// one validated call of it as a backend receives it (Call).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/arg.h"

namespace dtrain {

// torch.distributed.ReduceOp. BAND, BOR and BXOR (bitwise and, or, xor) are
// for integer tensors only (InvalidArgument otherwise, before anything is
// sent); nccl has no bitwise reductions and refuses them. PREMUL_SUM (the
// sum of each rank's input times a factor, PyTorch's
// _make_nccl_premul_sum) is for floating tensors, through the free
// functions with ReduceOptions::premul_factor, on every backend; a
// ProcessGroup method given it refuses it.
enum class ReduceOp { SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM };
// Whether `op` is one of the bitwise reductions.
inline bool is_bitwise(ReduceOp op) {
  return op == ReduceOp::BAND || op == ReduceOp::BOR || op == ReduceOp::BXOR;
}
const char* to_string(ReduceOp op);

// Everything a backend needs to build one group.
struct GroupOptions {
  DTRAIN_ARG(std::string, name) = "default";
  // Default timeout of every operation of the group.
  DTRAIN_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  // Address that peers use to reach this rank's listening sockets; empty:
  // derived from DTRAIN_SOCKET_IFNAME, else 127.0.0.1.
  DTRAIN_ARG(std::string, local_address) = "";
  // Global rank of each group rank; empty means the identity.
  DTRAIN_ARG(std::vector<int>, global_ranks) = {};
  // Fingerprint each collective across ranks before it runs; unset: on when
  // DTRAIN_DEBUG=DETAIL.
  DTRAIN_ARG(std::optional<bool>, check_collectives) = std::nullopt;
  // CUDA device of a device backend (nccl); -1: see InitOptions::device_id.
  DTRAIN_ARG(int, device_id) = -1;
};

using Timeout = std::optional<std::chrono::milliseconds>;

// recv's `src` for a message from any rank (torch.distributed's src=None).
inline constexpr int kAnySource = -1;

// Every operation of a ProcessGroup, by torch.distributed's name.
enum class OpType {
  ALL_REDUCE,
  BROADCAST,
  REDUCE,
  ALL_GATHER,
  GATHER,
  SCATTER,
  REDUCE_SCATTER,
  ALL_GATHER_INTO_TENSOR,
  REDUCE_SCATTER_TENSOR,
  ALL_TO_ALL,
  BARRIER,
  MONITORED_BARRIER,
  SEND,
  RECV,
};
const char* to_string(OpType type);  // "all_reduce", ...
// Whether `type` is numbered among the group's collectives (all but SEND
// and RECV).
inline bool is_collective(OpType type) { return type != OpType::SEND && type != OpType::RECV; }

// One operation as a descriptor: what each method of ProcessGroup builds
// and hands to ProcessGroup::issue, and what a backend receives. The
// in-place operations (all_reduce, broadcast, reduce) and recv hold their
// tensor in `outputs`, send in `inputs`; the others hold the arguments of
// the method of the same name.
struct Op {
  OpType type = OpType::BARRIER;
  std::vector<at::Tensor> inputs;   // read
  std::vector<at::Tensor> outputs;  // written (and read, in place)
  int root = -1;  // the root; for send and recv the peer (recv: or kAnySource)
  ReduceOp reduce_op = ReduceOp::SUM;
  int tag = 0;                  // send and recv
  bool wait_all_ranks = false;  // monitored_barrier
};

// One validated call, as a backend receives it.
struct Call {
  const char* op;           // "all_reduce", ...
  uint64_t seq;             // per group, counts collectives (not p2p)
  std::chrono::milliseconds timeout;
  std::string description;  // "all_reduce #3 on group 'default' (rank 1/4)"
  bool collective = true;   // false for send and recv (numbered apart)
  // The caller waits for it on its own thread (untimed) right after issuing
  // it: a call without async_op, on CPU tensors. A backend may leave it to
  // that wait to run (SerialExecutor::submit) instead of waking its thread.
  bool blocking = false;
};

}  // namespace dtrain
