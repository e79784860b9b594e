#pragma once

// The staging copy of a background save: this rank's part copied into
// host buffers (pinned for CUDA tensors) kept from one save to the next,
// so that the state may change while the copy is written.

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "checkpoint/storage/storage.h"

namespace c10 {
struct Event;
}

namespace dtrain::checkpoint::staging {

// A lane's buffers, by "r/<name>" and "s/<name>".
using Buffers = std::map<std::string, at::Tensor>;

// Copies `part`'s tensors into `buffers` (reused where a tensor's size and
// dtype are the same as at the last save) and points `part` at them;
// `buffers` keeps them for the next save when `reuse`. Test hook: a SIGKILL
// half way through when `die_half_way`.
void stage(storage::Part& part, Buffers& buffers, bool reuse, bool die_half_way);

// What training has queued on the caller's streams when a background save
// is called: the background copies wait for it (an event per device,
// recorded on that device's current stream at the call and waited on by
// the background thread's stream before its first copy). Without it, a
// copy on the background thread's default stream could read a tensor that
// a kernel queued on a side stream has not written yet. Nothing for CPU
// tensors.
class CallersStreams {
 public:
  explicit CallersStreams(const storage::Part& part);
  // On the background thread, before it copies: its streams wait.
  void order_this_thread() const;

 private:
  void record(const at::Tensor& t);
  std::vector<std::pair<c10::Device, std::shared_ptr<c10::Event>>> events_;
};

}  // namespace dtrain::checkpoint::staging
