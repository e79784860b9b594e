#pragma once

// The flight recorder: each process group keeps its last N operations
// (DTRAIN_TRACE_BUFFER_SIZE, default 2000; 0 turns it off) in a ring —
// sequence number, op, dtype, shape, root or peer, reduce op, state,
// times and label (op_label.h). When DTRAIN_TRACE_DIR is set, the process
// writes every group's ring to DIR/rank-<global rank>.json on its first
// failed operation
// (timeout, peer failure, mismatch) before the failure reaches the caller,
// on SIGUSR2, on SIGTERM (then it ends as SIGTERM would have ended it;
// both signals only where the program left their default action), and on
// dtrain::dump_flight_recorder(); `dtrain-trace analyze DIR` reads them.
// Recording costs one uncontended lock and a fixed-size copy per operation.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dtrain::detail {

// The group a recorder records, as its dumps name it.
struct RecordedGroup {
  std::string name;
  int rank = -1;  // in the group; -1: this process is not a member
  int size = 0;
  std::vector<int> global_ranks;
  std::string backend;
};

class FlightRecorder {
 public:
  // A recorder for `group` (null when the ring size is 0, or when this
  // process is not a member).
  static std::shared_ptr<FlightRecorder> create(const RecordedGroup& group);
  ~FlightRecorder();

  // Records an operation as issued; returns its slot id for finished().
  uint64_t issued(const char* op, bool collective, uint64_t seq, const at::Tensor& tensor,
                  int64_t root_or_peer, int64_t reduce_op);
  // The elements entry `id` moves (what `tensor` could not say: an
  // all_to_all's pieces, whose sizes differ from rank to rank, are recorded
  // by dtype only, and this is the sum of what this rank sends).
  void set_numel(uint64_t id, int64_t numel);
  // Marks slot `id` completed, or failed with `error`; a failure triggers
  // the process's failure dump (once) when DTRAIN_TRACE_DIR is set, and
  // returns only once that dump is durably in place (also when another
  // thread's failure is writing it).
  void finished(uint64_t id, const std::exception_ptr& error);

  // This group's ring as a JSON object (oldest first).
  std::string json() const;

 private:
  explicit FlightRecorder(const RecordedGroup& group, size_t capacity);

  struct Entry {
    uint64_t id = 0;  // 1-based position in the stream of records; 0: empty
    uint64_t seq = 0;
    const char* op = "";
    bool collective = true;
    int8_t dtype = -1;  // c10::ScalarType, -1 for none
    int8_t ndim = 0;    // dims kept in `sizes` (at most kMaxDims)
    int8_t state = 0;   // 0 issued, 1 completed, 2 failed
    int64_t root_or_peer = -1;
    int64_t reduce_op = -1;
    int64_t numel = 0;
    int64_t sizes[6] = {};
    int64_t issued_ns = 0, finished_ns = 0;  // steady clock
    std::string error;
    std::string label;  // detail::OpLabel's text when it was issued
  };

  const std::string group_name_;
  const int group_rank_;
  const int group_size_;
  const std::vector<int> global_ranks_;
  const std::string backend_;
  mutable std::mutex mutex_;
  std::vector<Entry> ring_;
  uint64_t next_id_ = 1;
};

// Writes every live group's ring to DIR/rank-<global rank>.json (DIR:
// `dir`, else DTRAIN_TRACE_DIR) atomically; returns the file's path.
// Throws InvalidArgument when neither names a directory. With
// `only_with_groups`, writes nothing (and returns "") when no group is
// alive, so a process ending keeps its earlier dump.
std::string dump_all(const std::string& reason, const std::string& dir = "",
                     bool only_with_groups = false);

}  // namespace dtrain::detail
