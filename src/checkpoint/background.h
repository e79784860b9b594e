#pragma once

// What async_save and async_snapshot share: the outcome of a job a
// background thread runs for a process group, the registry of each
// group's slot (the job in flight, its thread), and the thread's lower
// priority.

#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dtrain/process_group.h"

namespace dtrain::checkpoint::background {

// One job's outcome, shared by its handles and its group's slot.
struct Outcome {
  mutable std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  bool seen = false;  // a wait() threw its failure to somebody
  bool staged = false;  // the job's input copied (async_save's staging)
  std::exception_ptr error;

  void finish(std::exception_ptr e);
  void mark_staged();
  void wait_staged();  // until staged or done
  bool outcome_ready() const;
  // Blocks until done; its failure, marked as seen when `see`.
  std::exception_ptr outcome(bool see);
  // Blocks until done; its failure if nobody had seen it (now seen).
  std::exception_ptr unseen_failure();
};

// The calling thread's nice value goes 10 up (Linux keeps one per
// thread): where cores are short, training goes first.
void lower_this_threads_priority();

// What each group's slot holds at least: the group it is kept for, its job
// in flight (`Job` has outcome_ready()) and the thread that runs it.
template <typename Job>
struct SlotBase {
  std::weak_ptr<ProcessGroup> owner;
  std::shared_ptr<Job> pending;
  std::thread thread;

  void join() {
    if (thread.joinable()) thread.join();
  }
};

// Every group's slot (a SlotBase). A process that ends waits for the jobs
// in flight (static destruction joins them).
template <typename Slot>
struct Registry {
  std::mutex mutex;
  std::map<const ProcessGroup*, Slot> slots;

  ~Registry() {
    for (auto& [group, slot] : slots) slot.join();
  }
  // `group`'s slot; one left by a destroyed group at the same address is
  // replaced (after its job is done). Slots of destroyed groups whose jobs
  // are done go. Called with `mutex` held.
  Slot& slot_of(const std::shared_ptr<ProcessGroup>& group) {
    for (auto it = slots.begin(); it != slots.end();) {
      const bool idle = !it->second.pending || it->second.pending->outcome_ready();
      if (it->first != group.get() && it->second.owner.expired() && idle) {
        it->second.join();
        it = slots.erase(it);
      } else {
        ++it;
      }
    }
    auto& slot = slots[group.get()];
    if (slot.owner.lock() != group) {
      slot.join();
      slot = Slot();
      slot.owner = group;
    }
    return slot;
  }
  // The job in flight for `group`, if any.
  auto pending_of(const std::shared_ptr<ProcessGroup>& group) -> decltype(Slot().pending) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = slots.find(group.get());
    if (it == slots.end() || it->second.owner.lock() != group) return nullptr;
    return it->second.pending;
  }
};

// The one registry of slots of type `Slot`.
template <typename Slot>
Registry<Slot>& registry_of() {
  static Registry<Slot> registry;
  return registry;
}

}  // namespace dtrain::checkpoint::background
