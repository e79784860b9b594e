#pragma once

// Backend "auto": the fastest correct backend for where the ranks are.
//
// create_auto_group() asks every rank which machine it is on (shm/node.h).
// All on one machine: an shm group. Spread over machines: a
// HierarchicalProcessGroup, which runs all_reduce as an shm reduce to each
// machine's leader (its lowest rank), a tcp all_reduce among the leaders and
// an shm broadcast back; broadcast and barrier are hierarchical too. The
// other collectives and point-to-point go to a tcp group over all ranks
// (listed in docs/backends.md).
//
// The first timeout or transport error in any sub-group breaks the whole
// group, as on tcp and shm: every later call, point-to-point included,
// fails at once naming that first error.

#include <memory>

#include "dtrain/backend_hooks.h"
#include "core/serial_executor.h"
#include "dtrain/process_group.h"

namespace dtrain::hierarchical {

std::shared_ptr<ProcessGroup> create_auto_group(std::shared_ptr<Store> store, int rank, int size,
                                                const GroupOptions& options);

class HierarchicalProcessGroup final : public ProcessGroup {
 public:
  // nodes: the group ranks of each machine, as shm::group_by_node returns.
  HierarchicalProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                           GroupOptions options, std::vector<std::vector<int>> nodes);
  ~HierarchicalProcessGroup() override;

  std::string backend_name() const override;
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  DTRAIN_PROCESS_GROUP_HOOKS

 private:
  // Runs `body` in issue order on the group thread; it gets the time left.
  WorkPtr enqueue(const Call& call, std::function<void(const std::function<Timeout()>&)> body);
  // Null while the group works; else a Work failed with the first error.
  WorkPtr refuse_if_broken(const Call& call) const;

  std::vector<std::vector<int>> nodes_;
  int node_ = 0;                          // index of this rank's machine
  std::shared_ptr<ProcessGroup> local_;   // shm, ranks of this machine
  std::shared_ptr<ProcessGroup> leaders_; // tcp, one rank per machine (null elsewhere)
  std::shared_ptr<ProcessGroup> all_;     // tcp, every rank: the delegated operations
  SerialExecutor steps_;                  // last: drained first on destruction
};

}  // namespace dtrain::hierarchical
