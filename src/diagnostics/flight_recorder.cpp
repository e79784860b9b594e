#include "diagnostics/flight_recorder.h"
#include "diagnostics/op_label.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <thread>

#include "common/durable_file.h"
#include "common/enforce.h"
#include "common/error_text.h"
#include "common/env.h"
#include "common/json_text.h"
#include "common/logging.h"
#include "dtrain/operation.h"

namespace dtrain::detail {
namespace {

constexpr int kRecordedMaxDims = 6;
const char* const kStates[] = {"issued", "completed", "failed"};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}


// Every live recorder of the process.
struct RecorderRegistry {
  std::mutex mutex;
  std::vector<std::weak_ptr<FlightRecorder>> recorders;
  // The first failure dumps; a failure on another thread meanwhile waits
  // for that dump instead of returning to a caller that may end the process.
  std::once_flag failure_dump;
  // One dump at a time: two writers would share DIR/rank-R.json.tmp.
  std::mutex dump_mutex;
  int global_rank = -1;
  int world_size = -1;
};

RecorderRegistry& recorder_registry() {
  static auto* r = new RecorderRegistry;  // used from signal-driven and exiting threads: never destroyed
  return *r;
}

// SIGUSR2 and SIGTERM -> the signal's number on a pipe -> a thread that
// dumps (a signal handler may not allocate or lock). After SIGTERM's dump
// the thread restores SIGTERM's default action and raises it again, so the
// process still ends as killed by SIGTERM (a launcher stopping the
// survivors of a failure gets their dumps, as torchrun's workers leave
// theirs). Each handler is installed once, and only where the signal still
// has its default action, so a program's own handler is left alone.
int signal_pipe[2] = {-1, -1};

void on_dump_signal(int sig) {
  const char byte = static_cast<char>(sig);
  [[maybe_unused]] auto n = ::write(signal_pipe[1], &byte, 1);
}

void dump_on_signal(int sig) {
  const std::string name = sig == SIGTERM ? "SIGTERM" : "SIGUSR2";
  try {
    // A process ending (its groups destroyed) keeps the dump it has, e.g.
    // its failure's, rather than one with no group in it.
    const auto path = dump_all(name, "", /*only_with_groups=*/true);
    if (path.empty()) log_warning(cat("flight recorder: no process group is alive on ", name,
                                      "; an earlier dump is left as it is"));
    else log_warning(cat("flight recorder written to ", path));
  } catch (const std::exception& e) {
    log_warning(cat("flight recorder dump on ", name, " failed: ", e.what()));
  }
  if (sig != SIGTERM) return;
  ::signal(SIGTERM, SIG_DFL);
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_UNBLOCK, &term, nullptr);
  ::raise(SIGTERM);  // this thread has it unblocked: the default action ends the process
}

bool take_signal(int sig) {
  struct sigaction old {};
  if (sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) return false;
  struct sigaction action {};
  action.sa_handler = on_dump_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  return sigaction(sig, &action, nullptr) == 0;
}

void install_signal_dump() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (pipe2(signal_pipe, O_CLOEXEC) != 0) return;
    fcntl(signal_pipe[1], F_SETFL, O_NONBLOCK);
    std::thread([] {
      char byte;
      while (::read(signal_pipe[0], &byte, 1) == 1) dump_on_signal(byte);
    }).detach();
    take_signal(SIGUSR2);
    take_signal(SIGTERM);
  });
}

size_t ring_size() {
  static const size_t size =
      static_cast<size_t>(env::get_int(env::kTraceBufferSize, 0, 1000000).value_or(2000));
  return size;
}

}  // namespace

std::shared_ptr<FlightRecorder> FlightRecorder::create(const RecordedGroup& group) {
  const size_t capacity = ring_size();
  if (capacity == 0 || group.rank < 0) return nullptr;
  std::shared_ptr<FlightRecorder> recorder(new FlightRecorder(group, capacity));
  auto& r = recorder_registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.recorders.erase(std::remove_if(r.recorders.begin(), r.recorders.end(),
                                     [](const auto& w) { return w.expired(); }),
                      r.recorders.end());
    r.recorders.push_back(recorder);
    if (r.global_rank < 0 || group.name == "default") {
      r.global_rank = group.global_ranks[static_cast<size_t>(group.rank)];
      if (group.name == "default") r.world_size = group.size;
    }
  }
  if (env::get(env::kTraceDir)) install_signal_dump();
  return recorder;
}

FlightRecorder::FlightRecorder(const RecordedGroup& group, size_t capacity)
    : group_name_(group.name),
      group_rank_(group.rank),
      group_size_(group.size),
      global_ranks_(group.global_ranks),
      backend_(group.backend),
      ring_(capacity) {}

FlightRecorder::~FlightRecorder() = default;

uint64_t FlightRecorder::issued(const char* op, bool collective, uint64_t seq,
                                const at::Tensor& tensor, int64_t root_or_peer,
                                int64_t reduce_op) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t id = next_id_++;
  Entry& e = ring_[id % ring_.size()];
  e.id = id;
  e.seq = seq;
  e.op = op;
  e.collective = collective;
  e.root_or_peer = root_or_peer;
  e.reduce_op = reduce_op;
  e.state = 0;
  e.issued_ns = now_ns();
  e.finished_ns = 0;
  e.error.clear();
  e.label = OpLabel::current();
  if (tensor.defined()) {
    e.dtype = static_cast<int8_t>(tensor.scalar_type());
    e.ndim = static_cast<int8_t>(std::min<int64_t>(tensor.dim(), kRecordedMaxDims));
    for (int d = 0; d < e.ndim; ++d) e.sizes[d] = tensor.size(d);
    e.numel = tensor.numel();
  } else {
    e.dtype = -1;
    e.ndim = 0;
    e.numel = 0;
  }
  return id;
}

void FlightRecorder::set_numel(uint64_t id, int64_t numel) {
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = ring_[id % ring_.size()];
  if (e.id == id) e.numel = numel;
}

void FlightRecorder::finished(uint64_t id, const std::exception_ptr& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = ring_[id % ring_.size()];
    if (e.id != id) return;  // overwritten: the ring wrapped meanwhile
    e.state = error ? 2 : 1;
    e.finished_ns = now_ns();
    if (error) e.error = detail::error_text(error);
  }
  if (!error || !env::get(env::kTraceDir)) return;
  // Runs before the failed work's waiters are woken (Work::on_finish): the
  // dump is renamed into place and synced before the error can reach a
  // caller that lets it end the process.
  std::call_once(recorder_registry().failure_dump, [&] {
    try {
      log_warning(
          cat("flight recorder written to ", dump_all("failure: " + detail::error_text(error))));
    } catch (const std::exception& e) {
      log_warning(cat("flight recorder dump after a failure failed: ", e.what()));
    }
  });
}

std::string FlightRecorder::json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  // Steady-clock times become wall-clock microseconds since the epoch.
  const int64_t wall_minus_steady_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::system_clock::now().time_since_epoch())
          .count() -
      now_ns();
  auto wall_us = [&](int64_t steady) {
    return steady == 0 ? 0 : (steady + wall_minus_steady_ns) / 1000;
  };
  std::ostringstream out;
  out << "{\"name\": \"" << json_escaped(group_name_) << "\", \"rank\": " << group_rank_
      << ", \"size\": " << group_size_ << ", \"backend\": \"" << json_escaped(backend_)
      << "\", \"global_ranks\": [" << join(global_ranks_) << "], \"entries\": [";
  // One operation of each kind runs at a time: the oldest unfinished one
  // has started, the ones behind it are queued.
  bool started[2] = {false, false};
  bool first = true;
  const size_t n = ring_.size();
  const uint64_t begin = next_id_ > n ? next_id_ - n : 1;
  for (uint64_t id = begin; id < next_id_; ++id) {
    const Entry& e = ring_[id % n];
    if (e.id != id) continue;
    std::string state = kStates[e.state];
    if (e.state == 0 && !started[e.collective]) {
      started[e.collective] = true;
      state = "started";
    }
    out << (first ? "\n" : ",\n") << "  {\"seq\": " << e.seq << ", \"op\": \"" << e.op
        << "\", \"kind\": \"" << (e.collective ? "collective" : "p2p") << "\", \"dtype\": \""
        << (e.dtype >= 0 ? c10::toString(static_cast<c10::ScalarType>(e.dtype)) : "")
        << "\", \"shape\": [" << join(std::vector<int64_t>(e.sizes, e.sizes + e.ndim))
        << "], \"numel\": " << e.numel << ", \"root\": " << e.root_or_peer
        << ", \"reduce_op\": \""
        << (e.reduce_op >= 0 ? to_string(static_cast<ReduceOp>(e.reduce_op)) : "")
        << "\", \"state\": \"" << state << "\", \"issued_us\": " << wall_us(e.issued_ns)
        << ", \"finished_us\": " << wall_us(e.finished_ns) << ", \"error\": \""
        << json_escaped(e.error) << "\"";
    if (!e.label.empty()) out << ", \"label\": \"" << json_escaped(e.label) << "\"";
    out << "}";
    first = false;
  }
  out << "]}";
  return out.str();
}

std::string dump_all(const std::string& reason, const std::string& dir_arg, bool only_with_groups) {
  std::string dir = dir_arg.empty() ? env::get(env::kTraceDir).value_or("") : dir_arg;
  DTRAIN_CHECK_ARG(!dir.empty(),
                   "dump_flight_recorder: no directory given and DTRAIN_TRACE_DIR is not set");
  auto& r = recorder_registry();
  std::vector<std::shared_ptr<FlightRecorder>> live;
  int rank, world;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& w : r.recorders)
      if (auto p = w.lock()) live.push_back(std::move(p));
    rank = r.global_rank;
    world = r.world_size;
  }
  if (live.empty() && only_with_groups) return "";
  std::ostringstream out;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  out << "{\"format\": \"dtrain-flight-recorder\", \"version\": 1, \"rank\": " << rank
      << ", \"world_size\": " << world << ", \"pid\": " << ::getpid() << ", \"host\": \""
      << json_escaped(host) << "\", \"reason\": \"" << json_escaped(reason) << "\", \"groups\": [";
  for (size_t i = 0; i < live.size(); ++i) out << (i ? ",\n" : "\n") << live[i]->json();
  out << "]}\n";
  const std::string text = out.str();
  const std::string path = dir + "/rank-" + std::to_string(rank) + ".json";
  std::lock_guard<std::mutex> lock(r.dump_mutex);
  files::replace_durably(path, text.size(), [&](files::Sink& sink) {
    sink.write(text.data(), text.size());
  });
  return path;
}

}  // namespace dtrain::detail
