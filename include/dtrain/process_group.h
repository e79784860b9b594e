#pragma once

// ProcessGroup: a set of ranks that run collectives together, and the
// front door of its backends (backend.h): one per device type.
//
// The public methods below are the same for every backend. They check their
// arguments before anything is sent (InvalidArgument naming what is wrong),
// stage non-contiguous tensors through contiguous copies, fingerprint the
// call across ranks when DTRAIN_DEBUG=DETAIL, number it, and hand it to the
// backend of its tensors' device. Every call returns a Work (see work.h); the operation runs in
// issue order on the group's own thread, under `timeout` (the group's default
// when not given). Rank arguments here are ranks *within this group*.
//
// Tensors must stay alive and untouched until the Work completes (the Work
// keeps references, so dropping your handle is fine; writing to an input is
// not).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/backend.h"
#include "dtrain/operation.h"
#include "dtrain/store/store.h"
#include "dtrain/work.h"

namespace dtrain {
namespace detail {
class FlightRecorder;
}

// Which backend runs the operations on tensors of each device type.
using DeviceBackends = std::map<c10::DeviceType, BackendPtr>;

class ProcessGroup : public detail::OperationHooks {
 public:
  // A group over `backends` (at least one; they may share a backend). The
  // default backend, which runs operations without tensors (barrier), is
  // the CPU one where there is one, else the first.
  ProcessGroup(int rank, int size, GroupOptions options, DeviceBackends backends);
  ~ProcessGroup() override;
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
  // The backends' names: "tcp", "nccl", or "auto (...); CUDA tensors: nccl"
  // where CPU and CUDA tensors go to different backends.
  virtual std::string backend_name() const;
  // Device types the group's collectives accept (kCPU for tcp).
  virtual bool supports(c10::DeviceType type) const;
  // Where small control tensors go that DDP and the core exchange through
  // this group (fingerprints, used-parameter maps, bucket order, join
  // votes): the default backend's (the CPU, or the group's CUDA device on
  // nccl).
  virtual c10::Device control_device() const;
  // The backend of `type`'s tensors (c10d's _get_backend); null when none.
  BackendPtr backend(c10::DeviceType type) const;
  // Breaks the group at once, from any thread (c10d's abort, torchcomms'
  // abort()): every operation in flight and every later one fails with
  // NetworkError "group 'NAME' was aborted: <reason>", and the connections
  // close, so that the peers' operations fail at once too instead of
  // waiting out their timeouts. Destroy the group and make a new one.
  // BackendUnavailable on a backend that cannot (mpi).
  void abort(const std::string& reason);

 protected:
  // For a backend written before Backend existed (backend_hooks.h): a
  // subclass that writes the hooks of OperationHooks (post(), or the do_*
  // hooks), backend_name() and supports() itself; the group is then its
  // own backend.
  ProcessGroup(int rank, int size, GroupOptions options);

  const GroupOptions& options() const { return options_; }
  std::string hooks_owner() const override;
  int hooks_group_size() const override { return size_; }

 private:
  Call next_call(const char* op, Timeout timeout, bool collective);
  void check_member(const char* op) const;
  void check_op(const Op& op) const;
  void fingerprint(const Call& call, const at::Tensor& tensor, int64_t root, int64_t reduce_op);
  // The flight recorder (diagnostics/flight_recorder.h): record() notes an
  // operation as issued, begin() records and fingerprints a collective,
  // tracked() marks it finished when its work does.
  uint64_t record(const Call& call, const at::Tensor& tensor, int64_t root, int64_t reduce_op);
  // The backend of an operation's tensors (the default one for none);
  // null for a group that is its own backend.
  Backend* backend_for(const Op& op) const;
  // To the backend, or the group's own hooks; AVG lowered to SUM and a
  // division where the backend does not average.
  WorkPtr dispatch(const Call& call, Op op);
  std::vector<WorkPtr> dispatch_batch(const std::vector<Call>& calls, std::vector<Op> ops);
  uint64_t begin(const Call& call, const at::Tensor& tensor, int64_t root, int64_t reduce_op);
  WorkPtr tracked(uint64_t id, const Call& call, WorkPtr work);
  // DTRAIN_TIMELINE: draws `work` on this group's collectives track.
  void timeline_span(const Call& call, Work& work);

  int rank_;
  int size_;
  GroupOptions options_;
  std::vector<int> global_ranks_;
  bool check_collectives_;
  DeviceBackends backends_;  // empty for a group that is its own backend
  Backend* default_backend_ = nullptr;
  std::string backends_name_;  // backend_name() of a group over backends
  std::mutex issue_mutex_;  // numbering + handing over happen as one step
  uint64_t next_seq_ = 0;
  uint64_t next_p2p_ = 0;
  uint64_t next_batch_ = 0;
  std::shared_ptr<detail::FlightRecorder> recorder_;
  bool recorder_made_ = false;
  // " on group 'NAME' (rank R/N, backend B)": every call's description
  // ends so; made at the first call (backend_name() is virtual).
  std::string call_suffix_;
  std::shared_ptr<void> timeline_track_;  // diagnostics/timeline.h, created on first use
};

}  // namespace dtrain
