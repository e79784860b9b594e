#pragma once

// Backend "shm": collectives on CPU tensors between ranks of one machine,
// through one POSIX shared-memory segment per group (see docs/backends.md).
//
// Each rank owns a slot in the segment, split in two halves that successive
// pieces of a collective alternate between, so a rank can fill the next
// piece while slower peers still read the previous one. all_reduce is a
// reduce-scatter followed by an all-gather through the slots: each rank
// copies in the parts of its piece that others reduce, reduces its own part
// straight from its tensor, and copies the others' results out. Ranks step
// through pieces with a PhaseBarrier (spin, then futex; dead-peer aware).
//
// Collectives run in issue order on the group's thread. Every collective
// first checks, inside the segment and at no extra synchronization, that all
// ranks called the same operation on the same sizes and dtype: a mismatch is
// a CollectiveMismatch on every rank and leaves the group usable. A timeout
// or a dead peer breaks the group: later calls fail at once with that error.
//
// send/recv run on the tcp backend's engine over the shm transport (byte
// rings in a second segment, transport/shm/): no socket between the ranks.

#include <exception>
#include <memory>
#include <mutex>

#include "backends/shm/phase_barrier.h"
#include "transport/shm/segment.h"
#include "dtrain/backend_hooks.h"
#include "core/serial_executor.h"
#include "dtrain/process_group.h"

namespace dtrain::shm {

class ShmProcessGroup final : public ProcessGroup {
 public:
  ShmProcessGroup(std::shared_ptr<Store> store, int rank, int size, GroupOptions options);
  ~ShmProcessGroup() override;

  std::string backend_name() const override { return "shm"; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  DTRAIN_PROCESS_GROUP_HOOKS

 private:
  struct Stamp;
  struct Step;  // one collective in progress on the group thread

  void attach(Store& store);
  WorkPtr enqueue(const Call& call, std::function<void(Step&)> body);
  uint8_t* slot(int rank, int half) const;
  int64_t* exchange_table(uint64_t index) const;  // all_to_all byte counts

  void all_reduce_now(Step& step, const at::Tensor& tensor, ReduceOp op);
  void reduce_now(Step& step, const at::Tensor& tensor, int root, ReduceOp op);
  void gather_now(Step& step, const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                  int root);  // root -1: all_gather
  void all_to_all_now(Step& step, const std::vector<at::Tensor>& outputs,
                      const std::vector<at::Tensor>& inputs);

  Segment segment_;
  size_t half_bytes_ = 0;
  PhaseCounter* counters_ = nullptr;
  Stamp* stamps_ = nullptr;
  int64_t* tables_ = nullptr;
  uint8_t* data_ = nullptr;
  std::unique_ptr<PhaseBarrier> barrier_;
  uint64_t pieces_ = 0;  // pieces moved so far: picks the slot half
  uint64_t collectives_run_ = 0;  // picks the stamp and exchange-table slot
  std::shared_ptr<ProcessGroup> p2p_;
  SerialExecutor collectives_;  // last: drained first on destruction
};

}  // namespace dtrain::shm
