#include "checkpoint/rank0_step.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "common/enforce.h"
#include "core/internal_tags.h"
#include "dtrain/errors.h"
#include "dtrain/process_group.h"

namespace dtrain::checkpoint::detail {
namespace {

constexpr int64_t kAlive = 1, kDone = 0;

int tag_of(const ProcessGroup& group) {
  return group.max_tag() - dtrain::detail::kRank0StepTagFromTop;
}

std::chrono::milliseconds interval_of(const ProcessGroup& group) {
  return std::clamp<std::chrono::milliseconds>(group.timeout() / 4, std::chrono::milliseconds(1),
                                               std::chrono::seconds(1));
}

// Rank 0's word to every other rank, each send waited for (tiny: it goes
// at once, under the group's timeout).
void tell_all(ProcessGroup& group, int64_t word) {
  const dtrain::detail::InternalTraffic own;
  const auto on = at::TensorOptions().dtype(at::kLong).device(group.control_device());
  std::vector<WorkPtr> sends;
  for (int r = 1; r < group.size(); ++r) sends.push_back(group.send(at::full({1}, word, on), r, tag_of(group)));
  for (auto& w : sends) w->wait();
}

// While it lives, a thread of rank 0 tells the others it is alive.
class Heartbeat {
 public:
  explicit Heartbeat(ProcessGroup& group) : group_(group), every_(interval_of(group)) {
    thread_ = std::thread([this] { beat(); });
  }
  ~Heartbeat() { (void)stop(); }
  // Stops the beats and joins their thread; what stopped them early (a
  // peer gone), read only after the join.
  std::exception_ptr stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
    return error_;
  }

 private:
  void beat() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!cv_.wait_for(lock, every_, [&] { return stop_; })) {
      lock.unlock();
      try {
        tell_all(group_, kAlive);
      } catch (...) {
        error_ = std::current_exception();
        return;
      }
      lock.lock();
    }
  }
  ProcessGroup& group_;
  const std::chrono::milliseconds every_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace

std::string run_on_rank0(ProcessGroup& group, const std::string& what,
                         const std::function<std::string()>& step) {
  if (group.size() == 1) return step();
  if (group.rank() == 0) {
    Heartbeat heartbeat(group);
    const std::string outcome = step();
    if (auto beats = heartbeat.stop()) std::rethrow_exception(beats);
    tell_all(group, kDone);
    return outcome;
  }
  const dtrain::detail::InternalTraffic own;
  auto word = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(group.control_device()));
  for (;;) {
    try {
      group.recv(word, 0, tag_of(group))->wait();
    } catch (const TimeoutError& e) {
      throw TimeoutError(dtrain::detail::cat(what, ": rank 0 went silent while converting (", e.what(), ")"));
    } catch (const NetworkError& e) {
      throw NetworkError(dtrain::detail::cat(what, ": rank 0 left while converting (", e.what(), ")"));
    }
    if (word.cpu().item<int64_t>() == kDone) return "";
  }
}

}  // namespace dtrain::checkpoint::detail
