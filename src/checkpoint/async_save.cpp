// Asynchronous distributed checkpoints: plan and stage on the caller's
// thread, write and commit on a background writer (save_job.h has the two
// halves, which save() runs back to back).

#include "dtrain/checkpoint/async_save.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "checkpoint/background.h"
#include "checkpoint/distributed_files.h"
#include "checkpoint/save_job.h"
#include "common/error_text.h"
#include "common/enforce.h"
#include "dtrain/distributed.h"
#include "world/companion_group.h"

namespace dtrain::checkpoint {

namespace detail {

// One asynchronous save, shared by its handles and its group's slot.
struct PendingSave : background::Outcome {
  std::string dir;
};

}  // namespace detail

namespace {

using detail::PendingSave;

// What a saving group keeps between its asynchronous saves.
struct Slot : background::SlotBase<PendingSave> {
  std::shared_ptr<ProcessGroup> writers;
  std::map<std::string, at::Tensor> staging;  // by tensor-file name
};

auto& registry() { return background::registry_of<Slot>(); }

using background::lower_this_threads_priority;
using ::dtrain::detail::error_text;

// The writer group: the user's (checked), the slot's, or a new one.
std::shared_ptr<ProcessGroup> writers_for(Slot& slot, const std::shared_ptr<ProcessGroup>& group,
                                          const AsyncSaveOptions& options, const std::string& context) {
  if (auto w = options.writer_group()) {
    DTRAIN_CHECK_ARG(w.get() != group.get(), context,
                     ": writer_group must not be the saving group (the background writer's collectives "
                     "would interleave with the ones on the caller's thread)");
    DTRAIN_CHECK_ARG(w->rank() == group->rank() && w->size() == group->size(), context,
                     ": writer_group has rank ", w->rank(), " of ", w->size(), ", the saving group '",
                     group->name(), "' rank ", group->rank(), " of ", group->size(),
                     ": it must hold the same ranks in the same order");
    return w;
  }
  if (!slot.writers)
    slot.writers = dtrain::detail::new_companion_group(*group, "async_save", "checkpoint::async_save");
  return slot.writers;
}

// Copies `file`'s tensors into the slot's buffers (kept from the last save
// where a tensor's size and dtype are the same), and points `file` at them.
void stage(TensorFile& file, Slot& slot, bool reuse, bool die_half_way) {
  at::AutoGradMode no_grad(false);
  std::map<std::string, at::Tensor> staged;
  size_t n = 0;
  for (auto& [name, t] : file.tensors) {
    if (die_half_way && ++n > file.tensors.size() / 2) ::raise(SIGKILL);
    at::Tensor buffer;
    auto kept = slot.staging.find(name);
    if (kept != slot.staging.end() && kept->second.sizes() == t.sizes() &&
        kept->second.scalar_type() == t.scalar_type())
      buffer = kept->second;
    else
      buffer = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).pinned_memory(t.is_cuda()));
    buffer.copy_(t);
    t = buffer;
    staged[name] = buffer;
  }
  if (die_half_way) ::raise(SIGKILL);  // no tensor to stage: dies all the same
  slot.staging = reuse ? std::move(staged) : std::map<std::string, at::Tensor>();
}

// What training has queued on the caller's streams when async_save is
// called: the background copies wait for it (an event per device, recorded
// on that device's current stream at the call and waited on by the writer
// thread's stream before its first copy). Without it, a copy on the
// writer's default stream could read a tensor that a kernel queued on a
// side stream has not written yet. Nothing for CPU tensors.
class CallersStreams {
 public:
  explicit CallersStreams(const TensorFile& file) {
    for (const auto& [name, t] : file.tensors) {
      if (t.device().is_cpu() || seen(t.device())) continue;
      const auto* impl = c10::impl::getDeviceGuardImpl(t.device().type());
      auto event = std::make_shared<c10::Event>(t.device().type());
      event->record(impl->getStream(t.device()));
      events_.emplace_back(t.device(), std::move(event));
    }
  }
  // On the writer's thread, before it copies: its streams wait.
  void order_this_thread() const {
    for (const auto& [device, event] : events_)
      event->block(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
  }

 private:
  bool seen(const c10::Device& d) const {
    for (const auto& [device, event] : events_)
      if (device == d) return true;
    return false;
  }
  std::vector<std::pair<c10::Device, std::shared_ptr<c10::Event>>> events_;
};

}  // namespace

namespace files {

void wait_for_async_save(const std::shared_ptr<ProcessGroup>& group, const std::string& context) {
  if (!group) return;
  auto pending = registry().pending_of(group);
  if (!pending) return;
  if (auto error = pending->unseen_failure())
    throw Error(context + ": the asynchronous save to " + pending->dir + " before it failed: " + error_text(error));
}

}  // namespace files

AsyncSaveHandle::AsyncSaveHandle(std::shared_ptr<detail::PendingSave> pending)
    : pending_(std::move(pending)) {}

void AsyncSaveHandle::wait() const {
  DTRAIN_CHECK_ARG(pending_, "AsyncSaveHandle::wait: an empty handle (not returned by async_save)");
  if (auto error = pending_->outcome(true)) std::rethrow_exception(error);
}

void AsyncSaveHandle::wait_staged() const {
  DTRAIN_CHECK_ARG(pending_, "AsyncSaveHandle::wait_staged: an empty handle (not returned by async_save)");
  pending_->wait_staged();
}

bool AsyncSaveHandle::done() const {
  if (!pending_) return false;
  std::lock_guard<std::mutex> lock(pending_->mutex);
  return pending_->done;
}

std::exception_ptr AsyncSaveHandle::error() const {
  if (!pending_) return nullptr;
  std::lock_guard<std::mutex> lock(pending_->mutex);
  return pending_->done ? pending_->error : nullptr;
}

const std::string& AsyncSaveHandle::dir() const {
  static const std::string none;
  return pending_ ? pending_->dir : none;
}

AsyncSaveHandle async_save(const std::string& dir, const DistributedState& state, AsyncSaveOptions options) {
  auto group = options.process_group() ? options.process_group() : default_group();
  auto job = files::prepare_save(dir, state, group, "checkpoint::async_save", options.faults(),
                                 options.die_before_commit());
  const std::string context = job.context;
  // The slot is this group's: only this thread (the group's caller) uses
  // its buffers and writer group; the registry's lock guards the map and
  // what wait_for_async_save reads.
  auto& r = registry();
  Slot* slot;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    slot = &r.slot_of(group);
  }
  slot->join();  // finished: wait_for_async_save saw it done
  auto writers = writers_for(*slot, group, options, context);
  // A rank that cannot stage still takes part in the writer's first
  // agreement, so that every rank fails with its error. The slot's buffers
  // are the writer's until it is joined (the group's next async_save).
  auto stage_part = [slot, reuse = options.reuse_staging(), die = options.die_while_staging()](files::SaveJob& job) {
    return files::error_of([&] { stage(job.mine, *slot, reuse, die); });
  };
  const bool in_background = options.stage_in_background();
  std::string staging_error = in_background ? std::string() : stage_part(job);
  auto order = in_background ? std::make_shared<CallersStreams>(job.mine) : nullptr;
  auto pending = std::make_shared<PendingSave>();
  pending->dir = dir;
  if (!in_background) pending->mark_staged();
  std::thread writer([job = std::move(job), writers, pending, staging_error, in_background, stage_part,
                      order]() mutable {
    if (in_background) {  // at training's priority: its next step waits for it
      order->order_this_thread();
      staging_error = stage_part(job);
      pending->mark_staged();
    }
    lower_this_threads_priority();
    std::exception_ptr error;
    try {
      files::write_and_commit(job, *writers, staging_error);
    } catch (...) {
      error = std::current_exception();
    }
    pending->finish(error);
  });
  std::lock_guard<std::mutex> lock(r.mutex);
  slot->pending = pending;
  slot->thread = std::move(writer);
  return AsyncSaveHandle(pending);
}

}  // namespace dtrain::checkpoint
