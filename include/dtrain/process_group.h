#pragma once

// ProcessGroup: a set of ranks that run collectives together.
//
// The public methods below are the same for every backend. They check their
// arguments before anything is sent (InvalidArgument naming what is wrong),
// stage non-contiguous tensors through contiguous copies, fingerprint the
// call across ranks when DTRAIN_DEBUG=DETAIL, number it, and hand it to the
// backend. Every call returns a Work (see work.h); the operation runs in
// issue order on the group's own thread, under `timeout` (the group's default
// when not given). Rank arguments here are ranks *within this group*.
//
// Tensors must stay alive and untouched until the Work completes (the Work
// keeps references, so dropping your handle is fine; writing to an input is
// not).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/store/store.h"
#include "dtrain/work.h"

namespace dtrain {
namespace detail {
class FlightRecorder;
}

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

// One operation as a descriptor: what each method of ProcessGroup below
// builds and hands to ProcessGroup::issue, and what a backend (or a layer
// that forwards operations, like auto's CUDA routing) receives. The
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

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // In place: every rank ends with op(tensor of rank 0, ..., rank n-1).
  // AVG divides the sum by size() (truncating for integer dtypes).
  WorkPtr all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::SUM, Timeout timeout = {});
  WorkPtr broadcast(at::Tensor tensor, int root, Timeout timeout = {});
  // Root's tensor receives the reduction; other ranks' tensors are unchanged.
  WorkPtr reduce(at::Tensor tensor, int root, ReduceOp op = ReduceOp::SUM,
                 Timeout timeout = {});
  // outputs[i] receives rank i's input; size() outputs, each like input.
  WorkPtr all_gather(const std::vector<at::Tensor>& outputs, at::Tensor input,
                     Timeout timeout = {});
  // Root passes size() outputs; other ranks pass none.
  WorkPtr gather(const std::vector<at::Tensor>& outputs, at::Tensor input, int root,
                 Timeout timeout = {});
  // Root passes size() inputs, each like output; other ranks pass none.
  WorkPtr scatter(at::Tensor output, const std::vector<at::Tensor>& inputs, int root,
                  Timeout timeout = {});
  // output = op over ranks of inputs[rank()]; size() inputs, each like output.
  WorkPtr reduce_scatter(at::Tensor output, const std::vector<at::Tensor>& inputs,
                         ReduceOp op = ReduceOp::SUM, Timeout timeout = {});
  // Flat-buffer forms (torch.distributed's names): `output` holds size()
  // tensors like `input`, rank i's at position i, concatenated along dim 0
  // ([size() * d0, ...]) or stacked ([size(), d0, ...]). Bitwise the same
  // results as all_gather, with no list of tensors to build.
  WorkPtr all_gather_into_tensor(at::Tensor output, at::Tensor input, Timeout timeout = {});
  // `input` holds size() tensors like `output` (concatenated or stacked);
  // output = op over ranks of the rank()-th of them. Bitwise the same as
  // reduce_scatter; `input` is not modified.
  WorkPtr reduce_scatter_tensor(at::Tensor output, at::Tensor input, ReduceOp op = ReduceOp::SUM,
                                Timeout timeout = {});
  // outputs[j] receives inputs[rank()] of rank j; tensors may differ in size
  // from one peer to another but not in dtype.
  WorkPtr all_to_all(const std::vector<at::Tensor>& outputs,
                     const std::vector<at::Tensor>& inputs, Timeout timeout = {});
  WorkPtr barrier(Timeout timeout = {});
  // A barrier that says who is missing (torch.distributed.monitored_barrier):
  // every rank reports to rank 0, which releases them once all have. If a
  // rank has not reported within the timeout, rank 0's work fails with a
  // TimeoutError naming it (wait_all_ranks: naming every such rank), the
  // ranks that did arrive fail with "rank 0 found ranks that did not arrive"
  // (they wait for rank 0's verdict up to 1 s past the timeout), and the
  // group is broken. Meant for debugging hangs: it costs
  // 2(n-1) messages through rank 0.
  WorkPtr monitored_barrier(Timeout timeout = {}, bool wait_all_ranks = false);
  // Point to point. Sends and receives are matched by (peer, tag) in order;
  // they are posted at once and each completes on its own (not in posting
  // order), so isend/irecv pairs in any order never deadlock. A receiver
  // holds messages that come before their recv only up to a budget
  // (DTRAIN_TCP_UNEXPECTED_BYTES); a larger send completes once its recv is
  // posted, as in gloo and MPI, so post receives before waiting on the
  // sends they answer. recv from kAnySource takes the first message with
  // its tag from any rank (receives from a named rank are matched before
  // it); the work's source_rank() names the sender.
  // Tags run from 0 to max_tag(); those from internal_tags_from() up are
  // dtrain's own (pipeline schedules), and a send or recv there is refused.
  WorkPtr send(at::Tensor tensor, int dst, int tag = 0, Timeout timeout = {});
  WorkPtr recv(at::Tensor tensor, int src, int tag = 0, Timeout timeout = {});
  // The largest tag the backend takes: INT_MAX, or on mpi one below
  // MPI_TAG_UB (which the MPI standard only guarantees to be 32,767;
  // MPI_TAG_UB itself is monitored_barrier's).
  virtual int max_tag() const;
  // The first of dtrain's own tags: 2^28, or half of max_tag() + 1 where
  // the backend's range is smaller.
  int internal_tags_from() const;

  // Any of the operations above as a descriptor (each method is one call of
  // this): the same checks, numbering, diagnostics and staging, then the
  // backend.
  WorkPtr issue(Op op, Timeout timeout = {});
  // Sends and receives as one batch (batch_isend_irecv): every descriptor is
  // checked before any is numbered or posted, all are posted under one
  // issue step (nccl: one NCCL group call), and each carries the batch into
  // the flight recorder and the timeline. One work per descriptor, in order;
  // on nccl they are the one work of the group call.
  std::vector<WorkPtr> issue_batch(std::vector<Op> ops, Timeout timeout = {});

  int rank() const { return rank_; }  // -1 on a rank that is not a member
  int size() const { return size_; }
  const std::string& name() const { return options_.name(); }
  std::chrono::milliseconds timeout() const { return options_.timeout(); }
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  // Group rank of a global rank, or -1 when it is not a member.
  int group_rank_of(int global_rank) const;
  virtual std::string backend_name() const = 0;
  // Device types the backend's collectives accept (kCPU for tcp).
  virtual bool supports(c10::DeviceType type) const = 0;
  // Where small control tensors go that DDP and the core exchange through
  // this group (fingerprints, used-parameter maps, bucket order, join
  // votes): the CPU, or the group's CUDA device on nccl.
  virtual c10::Device control_device() const { return c10::Device(c10::DeviceType::CPU); }

 protected:
  ProcessGroup(int rank, int size, GroupOptions options);

  // One validated call, as the backend receives it.
  struct Call {
    const char* op;           // "all_reduce", ...
    uint64_t seq;             // per group, counts collectives (not p2p)
    std::chrono::milliseconds timeout;
    std::string description;  // "all_reduce #3 on group 'default' (rank 1/4)"
    bool collective = true;   // false for send and recv (numbered apart)
  };

  // Where a validated operation goes. Tensors are dense, contiguous, of one
  // dtype and on a supported device; lists have the sizes documented above.
  // By default each type goes to its hook below; a layer that forwards whole
  // operations (auto's CUDA routing) replaces this instead.
  virtual WorkPtr post(const Call& call, Op op);
  // Where a validated batch of sends and receives goes: by default each to
  // post(), in order.
  virtual std::vector<WorkPtr> post_batch(const std::vector<Call>& calls, std::vector<Op> ops);

  // Backend hooks, one per operation. A backend writes those it runs
  // (DTRAIN_PROCESS_GROUP_HOOKS, backend_hooks.h, declares all of them);
  // one it leaves out fails with BackendUnavailable naming it.
  virtual WorkPtr do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op);
  virtual WorkPtr do_broadcast(const Call& call, at::Tensor tensor, int root);
  virtual WorkPtr do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op);
  virtual WorkPtr do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                at::Tensor input);
  virtual WorkPtr do_gather(const Call& call, std::vector<at::Tensor> outputs,
                            at::Tensor input, int root);
  virtual WorkPtr do_scatter(const Call& call, at::Tensor output,
                             std::vector<at::Tensor> inputs, int root);
  virtual WorkPtr do_reduce_scatter(const Call& call, at::Tensor output,
                                    std::vector<at::Tensor> inputs, ReduceOp op);
  virtual WorkPtr do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                std::vector<at::Tensor> inputs);
  // The flat forms; by default the list forms on views of the flat tensor
  // (no copy), which a backend may replace with a path of its own.
  virtual WorkPtr do_all_gather_into_tensor(const Call& call, at::Tensor output,
                                            at::Tensor input);
  virtual WorkPtr do_reduce_scatter_tensor(const Call& call, at::Tensor output, at::Tensor input,
                                           ReduceOp op);
  virtual WorkPtr do_barrier(const Call& call);
  virtual WorkPtr do_monitored_barrier(const Call& call, bool wait_all_ranks);
  virtual WorkPtr do_send(const Call& call, at::Tensor tensor, int dst, int tag);
  virtual WorkPtr do_recv(const Call& call, at::Tensor tensor, int src, int tag);

  const GroupOptions& options() const { return options_; }

  // For a group that forwards its operations to `inner` (auto's routing
  // layer): `inner` no longer records, draws or fingerprints them, so each
  // operation is one flight-recorder entry, one timeline span and one check,
  // the outer group's.
  static void hide_diagnostics(ProcessGroup& inner);

 private:
  Call next_call(const char* op, Timeout timeout, bool collective);
  void check_member(const char* op) const;
  void check_op(const Op& op) const;
  void fingerprint(const Call& call, const at::Tensor& tensor, int64_t root, int64_t reduce_op);
  // The flight recorder (diagnostics/flight_recorder.h): record() notes an
  // operation as issued, begin() records and fingerprints a collective,
  // tracked() marks it finished when its work does.
  uint64_t record(const Call& call, const at::Tensor& tensor, int64_t root, int64_t reduce_op);
  uint64_t begin(const Call& call, const at::Tensor& tensor, int64_t root, int64_t reduce_op);
  WorkPtr tracked(uint64_t id, const Call& call, WorkPtr work);
  // DTRAIN_TIMELINE: draws `work` on this group's collectives track.
  void timeline_span(const Call& call, Work& work);

  int rank_;
  int size_;
  GroupOptions options_;
  std::vector<int> global_ranks_;
  bool check_collectives_;
  bool diagnostics_hidden_ = false;
  std::mutex issue_mutex_;  // numbering + handing over happen as one step
  uint64_t next_seq_ = 0;
  uint64_t next_p2p_ = 0;
  uint64_t next_batch_ = 0;
  std::shared_ptr<detail::FlightRecorder> recorder_;
  bool recorder_made_ = false;
  std::shared_ptr<void> timeline_track_;  // diagnostics/timeline.h, created on first use
};

}  // namespace dtrain
