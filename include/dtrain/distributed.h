#pragma once

// torch.distributed for C++: the default process group, subgroups and the
// collective functions. Names, argument order and semantics follow
// torch.distributed; ranks given to these functions (src, dst) are *global*
// ranks, also when a subgroup is passed, exactly as in PyTorch.
//
//   dtrain::init_process_group();                 // env://, backend auto
//   dtrain::all_reduce(t);                        // SUM, in place, blocking
//   auto w = dtrain::all_reduce(t, dtrain::AllReduceOptions()
//                                      .op(dtrain::ReduceOp::AVG).async_op(true));
//   w->wait();
//
// Every call returns a Work; without async_op it has already completed.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/process_group.h"
#include "dtrain/store/store.h"

namespace dtrain {

struct InitOptions {
  // "auto" (default): shm when every rank is on one machine, otherwise shm
  // within machines and tcp between them. "shm" and "tcp" force one
  // ("gloo", PyTorch's name, is an alias of "tcp"); "nccl" and "mpi" name
  // backends that a build may lack.
  DTRAIN_ARG(std::string, backend) = "auto";
  // "env://" (MASTER_ADDR, MASTER_PORT), "tcp://host:port" or
  // "file:///path"; ignored when store() is given.
  DTRAIN_ARG(std::string, init_method) = "env://";
  // -1: from RANK / WORLD_SIZE, else OMPI_COMM_WORLD_*, else SLURM_*.
  DTRAIN_ARG(int, rank) = -1;
  DTRAIN_ARG(int, world_size) = -1;
  // Default timeout of every blocking call; unset: DTRAIN_TIMEOUT (1800 s).
  DTRAIN_ARG(std::optional<std::chrono::milliseconds>, timeout) = std::nullopt;
  // Rendezvous through this store instead of init_method.
  DTRAIN_ARG(std::shared_ptr<Store>, store) = nullptr;
  // The CUDA device of this rank's nccl groups (PyTorch's device_id); -1:
  // LOCAL_RANK modulo the number of GPUs when LOCAL_RANK is set, else the
  // current CUDA device. Ignored by the CPU backends.
  DTRAIN_ARG(int, device_id) = -1;
};

// Creates the default group. Validates every input first (InvalidArgument
// naming the variable and its value), then waits until all ranks joined
// (TimeoutError "x/y ranks joined", naming the missing ranks).
void init_process_group(const InitOptions& options = InitOptions());
bool is_initialized();
// Waits for the default group's queued work, then releases every group.
void destroy_process_group();
int get_rank();
int get_world_size();
std::shared_ptr<ProcessGroup> default_group();
// The store of the default group (for user-level rendezvous data).
std::shared_ptr<Store> default_store();

struct NewGroupOptions {
  DTRAIN_ARG(std::string, backend) = "";  // empty: the default group's
  DTRAIN_ARG(std::optional<std::chrono::milliseconds>, timeout) = std::nullopt;
};

// Every rank of the default group must call new_group with the same ranks,
// in the same order of new_group calls. Ranks outside `ranks` get a handle
// whose rank() is -1 and whose collectives throw InvalidArgument.
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks,
                                        const NewGroupOptions& options = NewGroupOptions());

// torch.distributed.new_subgroups: the ranks of the default group cut into
// consecutive groups of `group_size` ([0..k), [k..2k), ...); it must divide
// the world size. Every rank builds every subgroup; returns this rank's and
// all of them (the others as non-member handles, whose rank() is -1).
std::pair<std::shared_ptr<ProcessGroup>, std::vector<std::shared_ptr<ProcessGroup>>> new_subgroups(
    int group_size, const NewGroupOptions& options = NewGroupOptions());
// torch.distributed.new_subgroups_by_enumeration: one subgroup per list of
// global ranks; the lists must not overlap. This rank's subgroup is null
// when no list holds it.
std::pair<std::shared_ptr<ProcessGroup>, std::vector<std::shared_ptr<ProcessGroup>>>
new_subgroups_by_enumeration(const std::vector<std::vector<int>>& ranks_per_subgroup,
                             const NewGroupOptions& options = NewGroupOptions());

// Backends are looked up by name; register your own before init. A
// Backend of your own (backend.h) with the device types whose tensors it
// runs: create_process_group gives a group over it for each of them.
using MakeBackend = std::function<BackendPtr(std::shared_ptr<Store> store, int rank, int size,
                                             const GroupOptions& options)>;
void register_backend(const std::string& name, std::vector<c10::DeviceType> devices,
                      MakeBackend make);
// The form before Backend existed, still supported: a factory of whole
// groups (a ProcessGroup subclass that writes the hooks itself).
using BackendFactory = std::function<std::shared_ptr<ProcessGroup>(
    std::shared_ptr<Store> store, int rank, int size, const GroupOptions& options)>;
void register_backend(const std::string& name, BackendFactory factory);
std::vector<std::string> available_backends();
// Builds a group directly on a store (tests, custom launchers). Throws
// BackendUnavailable for an unknown backend or one this build lacks.
std::shared_ptr<ProcessGroup> create_process_group(const std::string& backend,
                                                   std::shared_ptr<Store> store, int rank,
                                                   int size,
                                                   const GroupOptions& options = GroupOptions());

// --- collectives ---------------------------------------------------------
struct ReduceOptions {
  DTRAIN_ARG(ReduceOp, op) = ReduceOp::SUM;
  // ReduceOp::PREMUL_SUM's factor: each rank's input is multiplied by it
  // (inputs that are not outputs are copied first), then summed.
  DTRAIN_ARG(double, premul_factor) = 1.0;
  DTRAIN_ARG(bool, async_op) = false;
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;  // null: default group
  DTRAIN_ARG(Timeout, timeout) = std::nullopt;                 // unset: the group's
};
using AllReduceOptions = ReduceOptions;
using ReduceScatterOptions = ReduceOptions;

struct CollectiveOptions {
  DTRAIN_ARG(bool, async_op) = false;
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;
  DTRAIN_ARG(Timeout, timeout) = std::nullopt;
};

struct P2POptions {
  DTRAIN_ARG(int, tag) = 0;
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;
  DTRAIN_ARG(Timeout, timeout) = std::nullopt;
};

WorkPtr all_reduce(at::Tensor tensor, const AllReduceOptions& options = AllReduceOptions());
WorkPtr broadcast(at::Tensor tensor, int src, const CollectiveOptions& options = CollectiveOptions());
WorkPtr reduce(at::Tensor tensor, int dst, const ReduceOptions& options = ReduceOptions());
WorkPtr all_gather(const std::vector<at::Tensor>& outputs, at::Tensor input,
                   const CollectiveOptions& options = CollectiveOptions());
// `outputs` only on dst (one per rank); other ranks pass {}.
WorkPtr gather(at::Tensor input, const std::vector<at::Tensor>& outputs, int dst,
               const CollectiveOptions& options = CollectiveOptions());
// `inputs` only on src (one per rank); other ranks pass {}.
WorkPtr scatter(at::Tensor output, const std::vector<at::Tensor>& inputs, int src,
                const CollectiveOptions& options = CollectiveOptions());
WorkPtr reduce_scatter(at::Tensor output, const std::vector<at::Tensor>& inputs,
                       const ReduceScatterOptions& options = ReduceScatterOptions());
// Flat-buffer forms: `output` (all_gather) or `input` (reduce_scatter) holds
// one tensor per rank, concatenated along dim 0 or stacked.
WorkPtr all_gather_into_tensor(at::Tensor output, at::Tensor input,
                               const CollectiveOptions& options = CollectiveOptions());
WorkPtr reduce_scatter_tensor(at::Tensor output, at::Tensor input,
                              const ReduceScatterOptions& options = ReduceScatterOptions());
WorkPtr all_to_all(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                   const CollectiveOptions& options = CollectiveOptions());
// torch.distributed.all_to_all_single: rank r sends input's dim-0 rows
// [sum(input_split_sizes[0..j)), +input_split_sizes[j]) to rank j and
// receives rank j's rows for it into output at sum(output_split_sizes[0..j)).
// Empty split sizes: dim 0 divided equally (it must divide by the group
// size). Split sizes are rows, one per rank of the group.
WorkPtr all_to_all_single(at::Tensor output, at::Tensor input,
                          const std::vector<int64_t>& output_split_sizes = {},
                          const std::vector<int64_t>& input_split_sizes = {},
                          const CollectiveOptions& options = CollectiveOptions());
WorkPtr barrier(const CollectiveOptions& options = CollectiveOptions());
// torch.distributed.monitored_barrier: blocks; on rank 0 a TimeoutError names
// the rank that did not arrive in time (every such rank with
// wait_all_ranks). See ProcessGroup::monitored_barrier.
void monitored_barrier(const std::shared_ptr<ProcessGroup>& group = nullptr, Timeout timeout = {},
                       bool wait_all_ranks = false);
// The flight recorder: writes the last operations of every process group of
// this process (DTRAIN_TRACE_BUFFER_SIZE of each) to DIR/rank-<rank>.json,
// DIR being `dir` or else DTRAIN_TRACE_DIR (InvalidArgument when neither is
// given), and returns the file's path. With DTRAIN_TRACE_DIR set the same
// happens on the first failed operation and on SIGUSR2;
// `dtrain-trace analyze DIR` reads the files. See docs/debugging.md.
std::string dump_flight_recorder(const std::string& dir = "");

// Blocking point to point, and their asynchronous forms. recv returns the
// sender's global rank: `src`, or for src = kAnySource the rank whose
// message it took (torch.distributed.recv with src=None); irecv's work
// names it (as a rank of the group) with source_rank().
void send(at::Tensor tensor, int dst, const P2POptions& options = P2POptions());
int recv(at::Tensor tensor, int src, const P2POptions& options = P2POptions());
WorkPtr isend(at::Tensor tensor, int dst, const P2POptions& options = P2POptions());
WorkPtr irecv(at::Tensor tensor, int src, const P2POptions& options = P2POptions());

// torch.distributed.P2POp and batch_isend_irecv: `op` is dtrain::isend or
// dtrain::irecv, `peer` a global rank (kAnySource for a receive from any
// rank), `group` null for the default group. Every operation of a batch must
// use the same group; each is checked before any is posted (InvalidArgument
// naming the one at fault), all are posted at once (on nccl as one NCCL
// group call), and each completes on its own, whatever their order. The
// flight recorder and the timeline label each "batch_isend_irecv #k (i of n)".
using P2PFunction = WorkPtr (*)(at::Tensor, int, const P2POptions&);
struct P2POp {
  P2POp(P2PFunction op, at::Tensor tensor, int peer, std::shared_ptr<ProcessGroup> group = nullptr,
        int tag = 0)
      : op(op), tensor(std::move(tensor)), peer(peer), group(std::move(group)), tag(tag) {}
  P2PFunction op;
  at::Tensor tensor;
  int peer;
  std::shared_ptr<ProcessGroup> group;
  int tag;
};
// One work per operation, in order (on nccl the batch's one work, repeated).
std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& p2p_op_list);

}  // namespace dtrain
