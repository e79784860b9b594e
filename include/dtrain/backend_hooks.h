#pragma once

// The per-operation hooks of a backend (dtrain/backend.h), declared once
// (installed: a backend of your own, registered with register_backend,
// uses it too): a Backend writes DTRAIN_BACKEND_HOOKS in its protected
// section and defines each do_* in its .cpp. DTRAIN_PROCESS_GROUP_HOOKS is
// the same list, for backends written as ProcessGroup subclasses before
// Backend existed.

#define DTRAIN_PROCESS_GROUP_HOOKS                                                             \
  WorkPtr do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) override;            \
  WorkPtr do_broadcast(const Call& call, at::Tensor tensor, int root) override;                \
  WorkPtr do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) override;      \
  WorkPtr do_all_gather(const Call& call, std::vector<at::Tensor> outputs, at::Tensor input)   \
      override;                                                                                \
  WorkPtr do_gather(const Call& call, std::vector<at::Tensor> outputs, at::Tensor input,       \
                    int root) override;                                                        \
  WorkPtr do_scatter(const Call& call, at::Tensor output, std::vector<at::Tensor> inputs,      \
                     int root) override;                                                       \
  WorkPtr do_reduce_scatter(const Call& call, at::Tensor output,                               \
                            std::vector<at::Tensor> inputs, ReduceOp op) override;             \
  WorkPtr do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,                     \
                        std::vector<at::Tensor> inputs) override;                              \
  WorkPtr do_barrier(const Call& call) override;                                               \
  WorkPtr do_monitored_barrier(const Call& call, bool wait_all_ranks) override;                \
  WorkPtr do_send(const Call& call, at::Tensor tensor, int dst, int tag) override;             \
  WorkPtr do_recv(const Call& call, at::Tensor tensor, int src, int tag) override;

#define DTRAIN_BACKEND_HOOKS DTRAIN_PROCESS_GROUP_HOOKS
