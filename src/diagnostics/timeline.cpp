#include "diagnostics/timeline.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>

#include "common/env.h"
#include "common/json_text.h"
#include "common/logging.h"
#include "dtrain/timeline.h"

namespace dtrain::detail::timeline {
namespace {

std::atomic<int> process_rank{-1};

struct Writer {
  std::mutex mutex;
  FILE* file = nullptr;
  bool failed = false;
  int rank = -1;
  std::set<int> named;
  // Wall clock minus steady clock, in microseconds, taken once.
  int64_t offset_us = 0;

  // Opens PATH.rank-R.json at the first event (the rank is known by then);
  // false when the file cannot be written (said once).
  bool open() {
    if (file) return true;
    if (failed) return false;
    rank = process_rank >= 0 ? process_rank.load() : static_cast<int>(::getpid());
    const std::string path = *env::get(env::kTimeline) + ".rank-" + std::to_string(rank) + ".json";
    file = std::fopen(path.c_str(), "w");
    if (!file) {
      failed = true;
      log_warning("DTRAIN_TIMELINE: cannot write " + path + "; no timeline for this rank");
      return false;
    }
    const auto wall = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::system_clock::now().time_since_epoch());
    const auto steady = std::chrono::duration_cast<std::chrono::microseconds>(
        Clock::now().time_since_epoch());
    offset_us = wall.count() - steady.count();
    std::fprintf(file, "[\n{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": "
                       "{\"name\": \"rank %d\"}},\n", rank, rank);
    std::fprintf(file, "{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, \"args\": "
                       "{\"sort_index\": %d}},\n", rank, rank);
    return true;
  }

  int64_t us(Clock::time_point t) const {
    return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count() +
           offset_us;
  }
};

Writer& writer() {
  static auto* w = new Writer;  // written from exiting threads too: never destroyed
  return *w;
}

}  // namespace

void set_rank(int rank) { process_rank = rank; }

bool enabled() {
  static const bool on = env::get(env::kTimeline).has_value();
  return on;
}

void name_track(int track, const std::string& name) {
  if (!enabled()) return;
  auto& w = writer();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (!w.open() || !w.named.insert(track).second) return;
  std::fprintf(w.file, "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
                       "\"args\": {\"name\": \"%s\"}},\n", w.rank, track, json_escaped(name).c_str());
  std::fprintf(w.file, "{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": "
                       "%d, \"args\": {\"sort_index\": %d}},\n", w.rank, track, track);
}

void span(const std::string& name, int track, Clock::time_point begin, Clock::time_point end,
          const std::string& args) {
  if (!enabled()) return;
  auto& w = writer();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (!w.open()) return;
  const int64_t ts = w.us(begin);
  const int64_t dur = std::max<int64_t>(0, w.us(end) - ts);
  std::fprintf(w.file, "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %lld, "
                       "\"dur\": %lld, \"args\": {%s}},\n",
               json_escaped(name).c_str(), w.rank, track, static_cast<long long>(ts),
               static_cast<long long>(dur), args.c_str());
}

void flush() {
  if (!enabled()) return;
  auto& w = writer();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.file) std::fflush(w.file);
}

}  // namespace dtrain::detail::timeline

namespace dtrain {

TimelineSpan::TimelineSpan(const char* name)
    : name_(name),
      begin_(detail::timeline::enabled() ? std::chrono::steady_clock::now()
                                          : std::chrono::steady_clock::time_point()) {}

TimelineSpan::~TimelineSpan() {
  if (!detail::timeline::enabled()) return;
  detail::timeline::name_track(detail::timeline::kStepTrack, "step");
  detail::timeline::span(name_, detail::timeline::kStepTrack, begin_,
                         std::chrono::steady_clock::now());
}

}  // namespace dtrain
