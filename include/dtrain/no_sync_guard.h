#pragma once

// What ddp.no_sync() and fsdp.no_sync() return: turns gradient
// synchronization off for its lifetime and restores the previous setting
// when it goes out of scope. `Core` is the wrapper's engine (set_sync,
// sync_enabled).

namespace dtrain {

template <typename Core>
class ScopedNoSync {
 public:
  explicit ScopedNoSync(Core& core) : core_(&core), previous_(core.sync_enabled()) {
    core_->set_sync(false);
  }
  ~ScopedNoSync() {
    if (core_) core_->set_sync(previous_);
  }
  ScopedNoSync(ScopedNoSync&& other) noexcept : core_(other.core_), previous_(other.previous_) {
    other.core_ = nullptr;
  }
  ScopedNoSync(const ScopedNoSync&) = delete;
  ScopedNoSync& operator=(const ScopedNoSync&) = delete;
  ScopedNoSync& operator=(ScopedNoSync&&) = delete;

 private:
  Core* core_;
  bool previous_;
};

}  // namespace dtrain
