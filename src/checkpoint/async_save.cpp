// async_save(): the directory storage through the group's Checkpointer,
// planned and staged on the caller's thread, written and committed on its
// background thread.

#include "dtrain/checkpoint/async_save.h"

#include <mutex>
#include <utility>

#include "checkpoint/checkpointer.h"
#include "checkpoint/storage/directory/directory.h"
#include "common/enforce.h"
#include "dtrain/distributed.h"

namespace dtrain::checkpoint {

namespace detail {

// One asynchronous save, shared by its handles and its lane.
struct PendingSave : BackgroundJob {
  std::string dir;
};

}  // namespace detail

using detail::PendingSave;

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
  DTRAIN_CHECK_ARG(group != nullptr, "checkpoint::async_save ", dir, ": no process group (call init_process_group)");
  auto pending = std::make_shared<PendingSave>();
  pending->dir = dir;
  pending->described = "the asynchronous save to " + dir;
  BackgroundOptions background;
  background.companion = options.writer_group();
  background.companion_option = "writer_group";
  background.reuse_staging = options.reuse_staging();
  background.stage_in_background = options.stage_in_background();
  background.die_while_staging = options.die_while_staging();
  Checkpointer::of(group)->save_in_background(
      storage::directory::writer(dir, "checkpoint::async_save", options.faults(), options.die_before_commit()), state,
      pending, background);
  return AsyncSaveHandle(pending);
}

}  // namespace dtrain::checkpoint
