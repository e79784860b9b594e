// Asynchronous snapshots (snapshot.h): stage on the caller's thread, send,
// keep and complete on a background thread over a group of their own.

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "checkpoint/snapshot_transfer.h"
#include "common/enforce.h"
#include "world/companion_group.h"

namespace dtrain::checkpoint {

namespace detail {

struct PendingSnapshot {
  int64_t step = 0;
  mutable std::mutex mutex;
  std::condition_variable finished;
  bool done = false, seen = false;
  SnapshotInfo info;
  std::exception_ptr error;

  void finish(SnapshotInfo i, std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      info = i;
      error = std::move(e);
      done = true;
    }
    finished.notify_all();
  }
  std::exception_ptr outcome(bool see) {
    std::unique_lock<std::mutex> lock(mutex);
    finished.wait(lock, [&] { return done; });
    if (see) seen = true;
    return error;
  }
};

}  // namespace detail

namespace {

using detail::PendingSnapshot;

struct Slot {
  std::weak_ptr<ProcessGroup> owner;
  std::shared_ptr<ProcessGroup> transfers;
  std::shared_ptr<PendingSnapshot> pending;
  std::thread thread;
  void join() {
    if (thread.joinable()) thread.join();
  }
};

// Every group's slot; a process that leaves main with a snapshot in flight
// waits for it.
struct Registry {
  std::mutex mutex;
  std::map<const ProcessGroup*, Slot> slots;
  ~Registry() {
    for (auto& [group, slot] : slots) slot.join();
  }
  Slot& slot_of(const std::shared_ptr<ProcessGroup>& group) {
    auto& slot = slots[group.get()];
    if (slot.owner.lock() != group) {
      slot.join();
      slot = Slot();
      slot.owner = group;
    }
    return slot;
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

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
  std::shared_ptr<PendingSnapshot> pending;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.slots.find(group.get());
    if (it == r.slots.end() || it->second.owner.lock() != group) return;
    pending = it->second.pending;
  }
  if (!pending) return;
  bool seen_before;
  {
    std::lock_guard<std::mutex> lock(pending->mutex);
    seen_before = pending->seen;
  }
  auto error = pending->outcome(true);
  if (error && !seen_before)
    throw Error(context + ": the snapshot of step " + std::to_string(pending->step) +
                " before it failed: " + what_of(error));
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
  Context background = c;
  background.bytes = transfers_for(slot, c, options);
  lock.unlock();
  Staged staged = stage(c, step, state);  // the stall: the state read and encoded
  auto pending = std::make_shared<PendingSnapshot>();
  pending->step = step;
  lock.lock();
  slot.pending = pending;
  slot.thread = std::thread([background, staged = std::move(staged), pending]() mutable {
    // Training goes first where cores are short (Linux: a nice value per thread).
    const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
    errno = 0;
    const int nice = ::getpriority(PRIO_PROCESS, tid);
    if (errno == 0) ::setpriority(PRIO_PROCESS, tid, std::min(nice + 10, 19));
    SnapshotInfo info;
    std::exception_ptr error;
    try {
      info = transfer(background, std::move(staged));
    } catch (...) {
      error = std::current_exception();
    }
    pending->finish(info, error);
  });
  return AsyncSnapshot(pending);
}

}  // namespace dtrain::checkpoint
