#include "backends/mpi/backend.h"

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <mutex>
#include <thread>

#include "backends/mpi/runtime.h"
#include "core/failure_state.h"
#include "common/enforce.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"
#include "common/logging.h"

namespace dtrain::mpi_backend {

struct MpiBackend::Comm {
  MPI_Comm comm = MPI_COMM_NULL;
};

struct MpiBackend::Posted {
  MPI_Request request = MPI_REQUEST_NULL;
  bool cancellable = false;            // point to point (MPI cannot cancel collectives)
  std::vector<at::Tensor> buffers;     // what MPI reads or writes until the request is done
  std::vector<int> counts;             // MPI_Ialltoallv's count and displacement arrays
  bool receive = false;                // point-to-point receive: its source is recorded
  int source = -1;                     // MPI_SOURCE of a completed receive
};

namespace {

using Clock = std::chrono::steady_clock;

// Requests given up on after a timeout. MPI may still write into (or read
// from) their buffers: a cancelled receive that had already matched, a send
// Open MPI does not cancel, a collective (never cancellable) that the peers
// join late. Freeing those buffers would let MPI write into memory the
// program has reused, so they stay here until MPI_Test says the request is
// done — perhaps never (a peer that never joins): then until the process
// exits. Process-wide rather than per group: a broken group is meant to be
// destroyed, and its requests may outlive it (MPI_Comm_free defers to them).
class InFlight {
 public:
  void add(MPI_Request request, std::shared_ptr<void> keep) {
    std::lock_guard<std::mutex> lock(mutex_);
    requests_.push_back({request, std::move(keep)});
    count_ = requests_.size();
  }

  // MPI_Tests every request (one thread at a time, as MPI requires of one
  // request) and frees the buffers of those done; returns how many remain.
  size_t reap() {
    if (count_ == 0) return 0;  // the common case: one atomic load per call
    int finalized = 0;
    MPI_Finalized(&finalized);
    std::lock_guard<std::mutex> lock(mutex_);
    if (finalized) return requests_.size();
    for (size_t i = 0; i < requests_.size();) {
      int done = 0;
      MPI_Test(&requests_[i].request, &done, MPI_STATUS_IGNORE);
      if (done) {
        requests_[i] = std::move(requests_.back());
        requests_.pop_back();
      } else {
        ++i;
      }
    }
    count_ = requests_.size();
    return count_;
  }

 private:
  struct Entry {
    MPI_Request request;
    std::shared_ptr<void> keep;
  };
  std::mutex mutex_;
  std::vector<Entry> requests_;
  std::atomic<size_t> count_{0};
};

// Never destroyed: the buffers must outlive every use MPI makes of them,
// up to MPI_Finalize at exit.
InFlight& in_flight() {
  static auto* list = new InFlight;
  return *list;
}

std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, len);
}

// A truncated message is the ranks' mismatch (more was sent than posted),
// not a failure of MPI: named as the other backends name it.
void check(int code, const std::string& what) {
  if (code == MPI_SUCCESS) return;
  int error_class = MPI_ERR_OTHER;
  MPI_Error_class(code, &error_class);
  if (error_class == MPI_ERR_TRUNCATE)
    throw CollectiveMismatch(what + ": a peer sent more than this rank expected (MPI: " +
                             error_text(code) + "): the ranks called collectives of different "
                             "sizes, or a send larger than its recv");
  throw NetworkError(what + " failed: MPI error: " + error_text(code));
}

int count_of(const at::Tensor& t, const std::string& what) {
  DTRAIN_CHECK_ARG(t.numel() <= INT_MAX, what, ": MPI counts are int; ", t.numel(),
                   " elements is too many (split the tensor)");
  return static_cast<int>(t.numel());
}


at::Tensor concat(const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  for (const auto& p : parts) flat.push_back(p.reshape({-1}));
  return at::cat(flat);
}

void split_into(const at::Tensor& flat, const std::vector<at::Tensor>& outputs) {
  int64_t offset = 0;
  for (const auto& out : outputs) {
    out.view({-1}).copy_(flat.narrow(0, offset, out.numel()));
    offset += out.numel();
  }
}

}  // namespace

std::pair<int, int> mpi_world() { return world_rank_and_size(); }

size_t requests_in_flight() { return in_flight().reap(); }

PeerCounts peer_counts(const std::vector<int64_t>& numels, const std::string& what) {
  PeerCounts out;
  for (size_t peer = 0; peer < numels.size(); ++peer) {
    DTRAIN_CHECK_ARG(numels[peer] <= INT_MAX, what, ": MPI counts are int; ", numels[peer],
                     " elements for rank ", peer, " is too many (split the tensors)");
    DTRAIN_CHECK_ARG(out.total <= INT_MAX, what, ": MPI displacements are int; rank ", peer,
                     "'s piece would start after ", out.total, " elements, over 2^31-1 = ",
                     INT_MAX, " (send less per call)");
    out.counts.push_back(static_cast<int>(numels[peer]));
    out.displacements.push_back(static_cast<int>(out.total));
    out.total += numels[peer];
  }
  return out;
}

MpiBackend::MpiBackend(int rank, int size, GroupOptions options)
    : Backend(rank, size, std::move(options)), comm_(std::make_unique<Comm>()),
      p2p_(std::chrono::microseconds(50)) {
  ensure_initialized();
  const auto what = detail::cat("mpi: creating group '", name(), "' (rank ", rank, "/", size, ")");
  const auto [world_rank, world_size] = world_rank_and_size();
  const auto& members = this->options().global_ranks();
  if (members.empty()) {
    if (world_size != size || world_rank != rank)
      throw InvalidArgument(detail::cat(
          what, ": MPI_COMM_WORLD has this process as rank ", world_rank, " of ", world_size,
          "; with backend mpi, rank and world size come from mpirun (leave RANK and "
          "WORLD_SIZE unset or equal to MPI's)"));
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_->comm), what);
  } else {
    MPI_Group world_group, sub_group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, static_cast<int>(members.size()), members.data(), &sub_group);
    check(MPI_Comm_create_group(MPI_COMM_WORLD, sub_group, /*tag=*/0, &comm_->comm), what);
    MPI_Group_free(&sub_group);
    MPI_Group_free(&world_group);
  }
  MPI_Comm_set_errhandler(comm_->comm, MPI_ERRORS_RETURN);
  int comm_rank = -1;
  MPI_Comm_rank(comm_->comm, &comm_rank);
  DTRAIN_ENFORCE_EQ(comm_rank, rank);
  DTRAIN_LOG_INFO("mpi: group '", name(), "' ready, rank ", rank, "/", size);
}

MpiBackend::~MpiBackend() {
  // Queued collectives run first (each under its deadline), as on every
  // backend; then sends and receives still pending (a receive whose message
  // never came) are cancelled where MPI can and fail naming the destroyed
  // group, instead of holding the destructor to their deadlines (30 min by
  // default). Free the communicator unless MPI is already finalized
  // (process exit); MPI defers the free until requests still in flight on
  // it are done.
  collectives_.shutdown();
  p2p_.close(std::make_exception_ptr(NetworkError(detail::cat(
      "group '", name(), "' was destroyed while this operation was pending"))));
  in_flight().reap();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_->comm != MPI_COMM_NULL) MPI_Comm_free(&comm_->comm);
}

WorkPtr MpiBackend::launch(const Call& call, SerialExecutor& executor,
                                std::vector<at::Tensor> buffers,
                                const std::function<void(Posted&)>& post,
                                std::function<void()> after) {
  auto work = std::make_shared<Work>(call.description);
  in_flight().reap();  // buffers of requests abandoned earlier that are done by now
  if (failures_->refuse(*work)) return work;
  auto posted = std::make_shared<Posted>();
  posted->buffers = std::move(buffers);
  post(*posted);  // on the caller's thread, in issue order
  // The group's failure policy (core/failure_state.h): an InvalidArgument
  // or a CollectiveMismatch fails this call only. Either is raised once
  // MPI has finished the operation on this rank (a truncated message was
  // received and dropped), so the ranks are still in step; anything else
  // (a timeout, an MPI failure) breaks the group. The body runs even if
  // the group broke meanwhile: MPI must be done with the posted request.
  executor.submit([this, work, posted, after = std::move(after), call] {
    failures_->complete(*work, [&] {
      complete(call, posted);
      if (posted->receive) work->set_source_rank(posted->source);
      if (after) after();
    });
  });
  return work;
}

WorkPtr MpiBackend::launch_p2p(const Call& call, at::Tensor tensor,
                                    const std::function<void(Posted&)>& post) {
  auto work = std::make_shared<Work>(call.description);
  in_flight().reap();
  if (failures_->refuse(*work)) return work;
  auto posted = std::make_shared<Posted>();
  posted->buffers = {std::move(tensor)};
  post(*posted);  // on the caller's thread, in issue order
  CompletionWatcher::Op op;
  op.work = work;
  op.timeout = call.timeout;  // from the first wait (completion_watcher.h)
  op.test = [this, work, posted, call] {
    try {
      if (!test(call, *posted)) return false;
    } catch (...) {
      mark_broken(std::current_exception());
      throw;
    }
    if (posted->receive) work->set_source_rank(posted->source);
    return true;
  };
  op.expire = [this, work, posted, call](Clock::time_point) {
    try {
      expire(call, posted);
    } catch (...) {
      mark_broken(std::current_exception());
      throw;
    }
    if (posted->receive) work->set_source_rank(posted->source);
  };
  op.abandon = [posted] { abandon(*posted); };
  p2p_.add(std::move(op));
  return work;
}

// A failed send or recv breaks the group whatever the error, as a failed
// transport does on tcp.
void MpiBackend::mark_broken(std::exception_ptr error) { failures_->break_with(error); }

// The group is going: a receive not yet matched is cancelled (its buffer
// is never written); what MPI cannot cancel keeps its buffers alive in the
// requests in flight until MPI is done with it.
void MpiBackend::abandon(Posted& posted) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || posted.request == MPI_REQUEST_NULL) return;  // MPI writes nothing any more
  if (posted.cancellable) {
    int done = 0;
    MPI_Cancel(&posted.request);
    if (MPI_Test(&posted.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) return;
  }
  in_flight().add(posted.request, std::make_shared<std::vector<at::Tensor>>(posted.buffers));
  posted.request = MPI_REQUEST_NULL;
}

bool MpiBackend::test(const Call& call, Posted& posted) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized)  // the process is exiting; MPI_Test would be an error now
    throw NetworkError(detail::cat(call.description, ": MPI was finalized while it was pending"));
  int done = 0;
  MPI_Status status;
  check(MPI_Test(&posted.request, &done, &status), call.description);
  if (done && posted.receive) posted.source = status.MPI_SOURCE;
  return done != 0;
}

void MpiBackend::complete(const Call& call, const std::shared_ptr<Posted>& posted) {
  const auto deadline = Clock::now() + call.timeout;
  for (int polls = 0;; ++polls) {
    if (test(call, *posted)) return;
    if (Clock::now() >= deadline) break;
    // Poll hot at first, then back off so a waiting rank leaves the CPU.
    if (polls > 200) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  expire(call, posted);
}

void MpiBackend::expire(const Call& call, const std::shared_ptr<Posted>& posted) {
  MPI_Status status;
  const auto timed_out = detail::cat(call.description, " timed out after ", call.timeout.count(),
                                     " ms");
  if (posted->cancellable) {
    // A receive not yet matched is cancelled at once, and its buffer is
    // never written; one that matched meanwhile completes instead.
    int done = 0, cancelled = 0;
    MPI_Cancel(&posted->request);
    if (MPI_Test(&posted->request, &done, &status) == MPI_SUCCESS && done) {
      MPI_Test_cancelled(&status, &cancelled);
      if (!cancelled) {  // it completed after all: not a timeout
        if (posted->receive) posted->source = status.MPI_SOURCE;
        return;
      }
      throw TimeoutError(timed_out + " (cancelled; the group is broken)");
    }
  }
  // MPI still owns the request: keep its buffers (and the tensors) alive
  // until it is done, not just until this throw.
  in_flight().add(posted->request, posted);
  posted->request = MPI_REQUEST_NULL;
  throw TimeoutError(timed_out + (posted->cancellable
                                      ? " (MPI did not cancel it; the group is broken)"
                                      : " (MPI cannot cancel a collective; the group is broken)"));
}

WorkPtr MpiBackend::do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) {
  const int n = count_of(tensor, call.description);
  return launch(call, collectives_, {tensor}, [&](Posted& p) {
    check(MPI_Iallreduce(MPI_IN_PLACE, tensor.data_ptr(), n, datatype(tensor.scalar_type()),
                         reduction(tensor.scalar_type(), op), comm_->comm, &p.request),
          call.description);
  });
}

WorkPtr MpiBackend::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  const int n = count_of(tensor, call.description);
  return launch(call, collectives_, {tensor}, [&](Posted& p) {
    check(MPI_Ibcast(tensor.data_ptr(), n, datatype(tensor.scalar_type()), root, comm_->comm,
                     &p.request),
          call.description);
  });
}

WorkPtr MpiBackend::do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op) {
  const int n = count_of(tensor, call.description);
  const bool is_root = rank() == root;
  // Non-roots reduce from a copy so that their tensor stays unchanged.
  auto send = is_root ? tensor : tensor.clone();
  return launch(call, collectives_, {tensor, send}, [&](Posted& p) {
    check(MPI_Ireduce(is_root ? MPI_IN_PLACE : send.data_ptr(),
                      is_root ? tensor.data_ptr() : nullptr, n, datatype(tensor.scalar_type()),
                      reduction(tensor.scalar_type(), op), root, comm_->comm, &p.request),
          call.description);
  });
}

WorkPtr MpiBackend::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                       at::Tensor input) {
  const int n = count_of(input, call.description);
  auto flat = at::empty({int64_t(size()) * n}, input.options());
  return launch(
      call, collectives_, {input, flat},
      [&](Posted& p) {
        const auto type = datatype(input.scalar_type());
        check(MPI_Iallgather(input.data_ptr(), n, type, flat.data_ptr(), n, type, comm_->comm,
                             &p.request),
              call.description);
      },
      [flat, outputs] { split_into(flat, outputs); });
}

WorkPtr MpiBackend::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                                   at::Tensor input, int root) {
  const int n = count_of(input, call.description);
  const bool is_root = rank() == root;
  auto flat = is_root ? at::empty({int64_t(size()) * n}, input.options()) : at::Tensor();
  return launch(
      call, collectives_, {input, flat},
      [&](Posted& p) {
        const auto type = datatype(input.scalar_type());
        check(MPI_Igather(input.data_ptr(), n, type, is_root ? flat.data_ptr() : nullptr, n, type,
                          root, comm_->comm, &p.request),
              call.description);
      },
      [flat, outputs, is_root] {
        if (is_root) split_into(flat, outputs);
      });
}

WorkPtr MpiBackend::do_scatter(const Call& call, at::Tensor output,
                                    std::vector<at::Tensor> inputs, int root) {
  const int n = count_of(output, call.description);
  const bool is_root = rank() == root;
  auto flat = is_root ? concat(inputs) : at::Tensor();
  return launch(call, collectives_, {output, flat}, [&](Posted& p) {
    const auto type = datatype(output.scalar_type());
    check(MPI_Iscatter(is_root ? flat.data_ptr() : nullptr, n, type, output.data_ptr(), n, type,
                       root, comm_->comm, &p.request),
          call.description);
  });
}

WorkPtr MpiBackend::do_reduce_scatter(const Call& call, at::Tensor output,
                                           std::vector<at::Tensor> inputs, ReduceOp op) {
  const int n = count_of(output, call.description);
  auto flat = concat(inputs);
  return launch(call, collectives_, {output, flat}, [&](Posted& p) {
    check(MPI_Ireduce_scatter_block(flat.data_ptr(), output.data_ptr(), n,
                                    datatype(output.scalar_type()),
                                    reduction(output.scalar_type(), op), comm_->comm, &p.request),
          call.description);
  });
}

WorkPtr MpiBackend::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                       std::vector<at::Tensor> inputs) {
  std::vector<int64_t> send_numels, recv_numels;
  for (const auto& in : inputs) send_numels.push_back(in.numel());
  for (const auto& out : outputs) recv_numels.push_back(out.numel());
  const auto send = peer_counts(send_numels, call.description);
  const auto recv = peer_counts(recv_numels, call.description);
  auto flat_in = concat(inputs);
  auto flat_out = at::empty({recv.total}, flat_in.options());
  const size_t peers = send.counts.size();
  return launch(
      call, collectives_, {flat_in, flat_out},
      [&](Posted& p) {
        // The count arrays must outlive the request: they live in `p`.
        for (const auto* v : {&send.counts, &send.displacements, &recv.counts,
                              &recv.displacements})
          p.counts.insert(p.counts.end(), v->begin(), v->end());
        const int* c = p.counts.data();
        const auto type = datatype(flat_in.scalar_type());
        check(MPI_Ialltoallv(flat_in.data_ptr(), c, c + peers, type, flat_out.data_ptr(),
                             c + 2 * peers, c + 3 * peers, type, comm_->comm, &p.request),
              call.description);
      },
      [flat_out, outputs] { split_into(flat_out, outputs); });
}

WorkPtr MpiBackend::do_barrier(const Call& call) {
  return launch(call, collectives_, {}, [&](Posted& p) {
    check(MPI_Ibarrier(comm_->comm, &p.request), call.description);
  });
}

WorkPtr MpiBackend::do_send(const Call& call, at::Tensor tensor, int dst, int tag) {
  check_tag(call, tag);
  const int n = count_of(tensor, call.description);
  return launch_p2p(call, tensor, [&](Posted& p) {
    p.cancellable = true;
    check(MPI_Isend(tensor.data_ptr(), n, datatype(tensor.scalar_type()), dst, tag, comm_->comm,
                    &p.request),
          call.description);
  });
}

// The tag monitored_barrier uses: MPI_TAG_UB, which user tags may not reach.
static int reserved_tag(MPI_Comm comm) {
  int* ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm, MPI_TAG_UB, &ub, &found);
  return found && ub ? *ub : 32767;  // the least MPI guarantees
}

int MpiBackend::max_tag() const { return reserved_tag(comm_->comm) - 1; }

void MpiBackend::check_tag(const Call& call, int tag) const {
  const int reserved = reserved_tag(comm_->comm);
  DTRAIN_CHECK_ARG(tag < reserved, call.description, ": tag ", tag,
                   " is over this MPI's limit of ", reserved - 1,
                   " (MPI_TAG_UB = ", reserved, " is kept for monitored_barrier)");
}

// Rank 0 receives a byte from every rank, then sends one to each; it polls
// its receives so that at the deadline it can name the ranks that never
// sent, cancel what is still posted and fail the group.
WorkPtr MpiBackend::do_monitored_barrier(const Call& call, bool wait_all_ranks) {
  auto work = std::make_shared<Work>(call.description);
  if (failures_->refuse(*work)) return work;
  collectives_.submit([this, work, call, wait_all_ranks] {
    std::exception_ptr error;
    try {
      run_monitored_barrier(call, wait_all_ranks);
    } catch (...) {
      error = std::current_exception();
      failures_->break_with(error);  // as documented for monitored_barrier
    }
    work->finish(error);
  });
  return work;
}

void MpiBackend::run_monitored_barrier(const Call& call, bool wait_all_ranks) {
  const auto deadline = Clock::now() + call.timeout;
  const int tag = reserved_tag(comm_->comm), n = size();
  // One byte per peer, kept with its request until MPI is done with it.
  auto post = [&](bool send, int peer, uint8_t value = 1) {
    auto p = std::make_shared<Posted>();
    p->buffers = {at::full({1}, value, at::kByte)};
    p->cancellable = !send;
    void* byte = p->buffers[0].data_ptr();
    check(send ? MPI_Isend(byte, 1, MPI_BYTE, peer, tag, comm_->comm, &p->request)
               : MPI_Irecv(byte, 1, MPI_BYTE, peer, tag, comm_->comm, &p->request),
          call.description);
    return p;
  };
  // Rank 0 judges at its own deadline, about when the others' pass: its
  // verdict gets a second's grace to arrive.
  const auto verdict_deadline = deadline + std::chrono::seconds(1);
  auto finished = [&](Posted& p, Clock::time_point until) {
    while (Clock::now() < until) {
      int done = 0;
      check(MPI_Test(&p.request, &done, MPI_STATUS_IGNORE), call.description);
      if (done) return true;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return false;
  };
  auto abandon = [&](const std::shared_ptr<Posted>& p) {
    if (p->request == MPI_REQUEST_NULL) return;
    if (p->cancellable) MPI_Cancel(&p->request);
    in_flight().add(p->request, p);  // freed once MPI is done with it
    p->request = MPI_REQUEST_NULL;
  };
  if (rank() != 0) {
    auto release = post(false, 0, 0);
    auto report = post(true, 0);
    if (finished(*report, deadline) && finished(*release, verdict_deadline)) {
      if (release->buffers[0].item<uint8_t>() == 1) return;
      throw TimeoutError(detail::cat(call.description,
                                     ": rank 0 found ranks that did not arrive within ",
                                     call.timeout.count(), " ms (its error names them)"));
    }
    abandon(report);
    abandon(release);
    throw TimeoutError(detail::cat(call.description, " timed out after ", call.timeout.count(),
                                   " ms waiting for rank 0 to release it (rank 0 names the "
                                   "ranks that did not arrive)"));
  }
  std::vector<std::shared_ptr<Posted>> reports;
  for (int j = 1; j < n; ++j) reports.push_back(post(false, j));
  std::vector<int> missing;
  for (int j = 1; j < n; ++j) {
    if (finished(*reports[j - 1], deadline)) continue;
    missing.push_back(j);
    if (!wait_all_ranks) break;
  }
  if (!missing.empty()) {
    // The ranks that arrived learn it at once.
    std::vector<std::shared_ptr<Posted>> told;
    for (int j = 1; j < n; ++j)
      if (reports[j - 1]->request == MPI_REQUEST_NULL) told.push_back(post(true, j, 0));
    for (auto& p : told) abandon(p);  // MPI delivers them; we do not wait
    for (auto& p : reports) abandon(p);
    throw TimeoutError(detail::cat(
        call.description, ": ", missing.size() == 1 ? "rank " : "ranks ", detail::join(missing),
        " did not arrive within ", call.timeout.count(), " ms",
        wait_all_ranks ? "" : " (the first such rank; wait_all_ranks names them all)"));
  }
  std::vector<std::shared_ptr<Posted>> releases;
  for (int j = 1; j < n; ++j) releases.push_back(post(true, j));
  for (auto& p : releases)
    if (!finished(*p, verdict_deadline)) {
      for (auto& q : releases) abandon(q);
      throw TimeoutError(detail::cat(call.description, " timed out after ",
                                     call.timeout.count(), " ms releasing the ranks"));
    }
}

WorkPtr MpiBackend::do_recv(const Call& call, at::Tensor tensor, int src, int tag) {
  check_tag(call, tag);
  const int n = count_of(tensor, call.description);
  return launch_p2p(call, tensor, [&](Posted& p) {
    p.cancellable = true;
    p.receive = true;
    check(MPI_Irecv(tensor.data_ptr(), n, datatype(tensor.scalar_type()),
                    src == kAnySource ? MPI_ANY_SOURCE : src, tag, comm_->comm, &p.request),
          call.description);
  });
}

DTRAIN_REGISTER_BACKEND(mpi, {
  register_backend("mpi", {c10::DeviceType::CPU},
                   [](std::shared_ptr<Store>, int rank, int size, const GroupOptions& options) {
                     return std::make_shared<MpiBackend>(rank, size, options);
                   });
  detail::register_own_world("mpi", mpi_world);
})

}  // namespace dtrain::mpi_backend
