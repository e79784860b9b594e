// Asynchronous snapshots (snapshot.h): stage on the caller's thread, send,
// keep and complete on a background thread over a group of their own.

#include <mutex>
#include <thread>

#include "checkpoint/background.h"
#include "checkpoint/snapshot_transfer.h"
#include "common/error_text.h"
#include "common/enforce.h"
#include "world/companion_group.h"

namespace dtrain::checkpoint {

namespace detail {

struct PendingSnapshot : background::Outcome {
  int64_t step = 0;
  SnapshotInfo info;  // written before finish()
};

}  // namespace detail

namespace {

using detail::PendingSnapshot;

struct Slot : background::SlotBase<PendingSnapshot> {
  std::shared_ptr<ProcessGroup> transfers;
};

auto& registry() { return background::registry_of<Slot>(); }

std::shared_ptr<ProcessGroup> transfers_for(Slot& slot, const snapshot_detail::Context& c,
                                            const SnapshotOptions& options) {
  if (auto t = options.transfer_group()) {
    DTRAIN_CHECK_ARG(t.get() != c.group.get(), c.what,
                     ": transfer_group must not be the snapshot's group (the background collectives would "
                     "interleave with the ones on the caller's thread)");
    DTRAIN_CHECK_ARG(t->rank() == c.rank && t->size() == c.world, c.what, ": transfer_group has rank ", t->rank(),
                     " of ", t->size(), ", the snapshot's group rank ", c.rank, " of ", c.world,
                     ": it must hold the same ranks in the same order");
    return t;
  }
  if (!slot.transfers)
    slot.transfers = dtrain::detail::new_companion_group(*c.group, "snapshot", "checkpoint::async_snapshot");
  return slot.transfers;
}

}  // namespace

namespace snapshot_detail {

void wait_for_async_snapshot(const std::shared_ptr<ProcessGroup>& group, const std::string& context) {
  auto pending = registry().pending_of(group);
  if (!pending) return;
  if (auto error = pending->unseen_failure())
    throw Error(context + ": the snapshot of step " + std::to_string(pending->step) + " before it failed: " +
                ::dtrain::detail::error_text(error));
}

}  // namespace snapshot_detail

SnapshotInfo AsyncSnapshot::wait() {
  DTRAIN_CHECK_ARG(pending_ != nullptr, "AsyncSnapshot::wait: this handle holds no snapshot");
  if (auto e = pending_->outcome(true)) std::rethrow_exception(e);
  std::lock_guard<std::mutex> lock(pending_->mutex);
  return pending_->info;
}

bool AsyncSnapshot::done() const {
  if (!pending_) return true;
  std::lock_guard<std::mutex> lock(pending_->mutex);
  return pending_->done;
}

AsyncSnapshot async_snapshot(int64_t step, const DistributedState& state, const SnapshotOptions& options) {
  using namespace snapshot_detail;
  Context c = context_of(options, "checkpoint::async_snapshot of step " + std::to_string(step));
  wait_for_async_snapshot(c.group, c.what);
  auto& r = registry();
  std::unique_lock<std::mutex> lock(r.mutex);
  Slot& slot = r.slot_of(c.group);
  slot.join();
  Context transfers = c;
  transfers.bytes = transfers_for(slot, c, options);
  lock.unlock();
  Staged staged = stage(c, step, state);  // the stall: the state read and encoded
  auto pending = std::make_shared<PendingSnapshot>();
  pending->step = step;
  lock.lock();
  slot.pending = pending;
  slot.thread = std::thread([transfers = std::move(transfers), staged = std::move(staged), pending]() mutable {
    background::lower_this_threads_priority();
    std::exception_ptr error;
    try {
      pending->info = transfer(transfers, std::move(staged));
    } catch (...) {
      error = std::current_exception();
    }
    pending->finish(error);
  });
  return AsyncSnapshot(pending);
}

}  // namespace dtrain::checkpoint
