// snapshot(), async_snapshot() and restore_snapshot(): the keepers storage
// through the group's Checkpointer (storage/keepers/keepers.h).

#include "dtrain/checkpoint/snapshot.h"

#include <mutex>
#include <utility>

#include "checkpoint/checkpointer.h"
#include "checkpoint/storage/keepers/keepers.h"
#include "common/enforce.h"
#include "dtrain/distributed.h"

namespace dtrain::checkpoint {

namespace detail {

struct PendingSnapshot : BackgroundJob {
  int64_t step = 0;
};

}  // namespace detail

namespace {

using storage::keepers::kLane;

// The keeper's socket first: without dtrain-run, that is what to say.
std::shared_ptr<ProcessGroup> group_of(const SnapshotOptions& options, const std::string& what, std::string& socket) {
  socket = storage::keepers::keeper_socket(options.keeper_socket(), what);
  return options.process_group() ? options.process_group() : default_group();
}

std::pair<std::shared_ptr<ProcessGroup>, storage::keepers::Keeper> keeper_for(int64_t step,
                                                                              const SnapshotOptions& options,
                                                                              const std::string& what) {
  const std::string context = what + " of step " + std::to_string(step);
  std::string socket;
  auto group = group_of(options, context, socket);
  DTRAIN_CHECK_ARG(step >= 0, context, ": the step must not be negative");
  return {group, storage::keepers::keeper_of(socket, *group, context)};
}

}  // namespace

SnapshotInfo snapshot(int64_t step, const DistributedState& state, const SnapshotOptions& options) {
  auto [group, keeper] = keeper_for(step, options, "checkpoint::snapshot");
  auto writer = storage::keepers::writer(step, std::move(keeper));
  const auto written = Checkpointer::of(group)->save(*writer, state);
  return SnapshotInfo{step, written.part_bytes, written.sent_bytes};
}

SnapshotInfo AsyncSnapshot::wait() {
  DTRAIN_CHECK_ARG(pending_ != nullptr, "AsyncSnapshot::wait: this handle holds no snapshot");
  if (auto e = pending_->outcome(true)) std::rethrow_exception(e);
  std::lock_guard<std::mutex> lock(pending_->mutex);
  return SnapshotInfo{pending_->step, pending_->written.part_bytes, pending_->written.sent_bytes};
}

bool AsyncSnapshot::done() const {
  if (!pending_) return true;
  std::lock_guard<std::mutex> lock(pending_->mutex);
  return pending_->done;
}

AsyncSnapshot async_snapshot(int64_t step, const DistributedState& state, const SnapshotOptions& options) {
  auto [group, keeper] = keeper_for(step, options, "checkpoint::async_snapshot");
  auto writer = storage::keepers::writer(step, std::move(keeper));
  auto pending = std::make_shared<detail::PendingSnapshot>();
  pending->step = step;
  pending->described = "the snapshot of step " + std::to_string(step);
  BackgroundOptions background;
  background.companion = options.transfer_group();
  background.companion_option = "transfer_group";
  background.group_called = "the snapshot's group";
  background.background_called = "the background collectives";
  Checkpointer::of(group)->save_in_background(std::move(writer), state, pending, background);
  return AsyncSnapshot(pending);
}

std::optional<int64_t> restore_snapshot(DistributedState& state, int64_t newer_than, const SnapshotOptions& options) {
  const std::string what = "checkpoint::restore_snapshot";
  std::string socket;
  auto group = group_of(options, what, socket);
  auto keeper = storage::keepers::keeper_of(socket, *group, what);
  auto checkpointer = Checkpointer::of(group);
  checkpointer->wait_for(kLane, what);
  storage::keepers::SnapshotReader reader(std::move(keeper), checkpointer->cpu_group(kLane), newer_than);
  if (!load_state(reader, state)) return std::nullopt;
  return reader.step();
}

}  // namespace dtrain::checkpoint
