#include "checkpoint/checkpointer.h"

#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "checkpoint/staging.h"
#include "checkpoint/state/check.h"
#include "common/enforce.h"
#include "common/error_text.h"
#include "world/companion_group.h"

namespace dtrain::checkpoint {

// A lane: the job in flight, the thread that runs it, the companion group
// and the staging buffers.
struct Checkpointer::Lane {
  std::string name;
  std::shared_ptr<BackgroundJob> pending;
  std::thread thread;
  std::shared_ptr<ProcessGroup> companion;
  staging::Buffers buffers;

  void join() {
    if (thread.joinable()) thread.join();
  }
};

namespace {

// Every group's Checkpointer: the only registry. One of a destroyed group
// goes at a later lookup once its jobs are done (never joined under the
// registry's lock while one runs); at the process's end the registry's
// destruction waits for the jobs in flight.
struct Registry {
  std::mutex mutex;
  std::map<const ProcessGroup*, std::pair<std::weak_ptr<ProcessGroup>, std::shared_ptr<Checkpointer>>> of;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

std::shared_ptr<Checkpointer> Checkpointer::of(const std::shared_ptr<ProcessGroup>& group) {
  DTRAIN_ENFORCE(group != nullptr);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.of.begin(); it != r.of.end();)
    it = it->first != group.get() && it->second.first.expired() && it->second.second.use_count() == 1 &&
                 !it->second.second->busy()
             ? r.of.erase(it)  // joins its finished threads
             : std::next(it);
  auto& entry = r.of[group.get()];
  if (entry.first.lock() != group || !entry.second) entry = {group, std::make_shared<Checkpointer>(group)};
  return entry.second;
}

Checkpointer::Checkpointer(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {}

Checkpointer::~Checkpointer() {
  for (auto& [name, lane] : lanes_) lane->join();
}

std::shared_ptr<ProcessGroup> Checkpointer::group() const {
  auto g = group_.lock();
  DTRAIN_ENFORCE(g != nullptr);  // the caller holds the group
  return g;
}

bool Checkpointer::busy() const {
  for (const auto& [name, l] : lanes_)
    if (l->pending && !l->pending->outcome_ready()) return true;
  return false;
}

Checkpointer::Lane& Checkpointer::lane(const std::string& name) {
  auto& lane = lanes_[name];
  if (!lane) {
    lane = std::make_unique<Lane>();
    lane->name = name;
  }
  return *lane;
}

void Checkpointer::wait_for(const std::string& name, const std::string& context) {
  auto it = lanes_.find(name);
  if (it == lanes_.end() || !it->second->pending) return;
  const auto& job = it->second->pending;
  if (auto error = job->unseen_failure())
    throw Error(context + ": " + job->described + " before it failed: " + ::dtrain::detail::error_text(error));
}

std::shared_ptr<ProcessGroup> Checkpointer::cpu_group(const std::string& name) {
  auto g = group();
  if (g->backend_name() != "nccl") return g;
  return companion(lane(name), BackgroundOptions(), "checkpoint::" + name);
}

std::shared_ptr<ProcessGroup> Checkpointer::companion(Lane& l, const BackgroundOptions& options,
                                                      const std::string& context) {
  auto g = group();
  if (auto c = options.companion) {
    const std::string& option = options.companion_option;
    DTRAIN_CHECK_ARG(c.get() != g.get(), context, ": ", option, " must not be ", options.group_called, " (",
                     options.background_called, " would interleave with the ones on the caller's thread)");
    DTRAIN_CHECK_ARG(c->rank() == g->rank() && c->size() == g->size(), context, ": ", option, " has rank ",
                     c->rank(), " of ", c->size(), ", ", options.group_called, " '", g->name(), "' rank ", g->rank(),
                     " of ", g->size(), ": it must hold the same ranks in the same order");
    return c;
  }
  if (!l.companion) l.companion = dtrain::detail::new_companion_group(*g, l.name, "checkpoint::" + l.name);
  return l.companion;
}

namespace {

struct Planned {
  files::SavePlan plan;
  storage::Part part;
};

// The steps every save runs on the caller's thread: the state read as it
// is now, checked, planned (collective), the storage prepared
// (collective), this rank's part chosen.
Planned plan_and_prepare(storage::Writer& writer, const std::shared_ptr<ProcessGroup>& group,
                         const DistributedState& state) {
  for (const auto& hook : state.before_save) hook();
  state_checks::check_local(state);
  Planned p;
  p.plan = files::plan_save(group, state);
  writer.prepare(*group);
  p.part = writer.select(state, p.plan, group->rank());
  return p;
}

}  // namespace

storage::Written Checkpointer::save(storage::Writer& writer, const DistributedState& state) {
  auto g = group();
  DTRAIN_CHECK_ARG(g->rank() >= 0, writer.context(), ": this rank is not in the group");
  wait_for(writer.lane(), writer.context());
  Planned p = plan_and_prepare(writer, g, state);
  auto on = writer.needs_cpu_group() ? cpu_group(writer.lane()) : g;
  return writer.write(p.part, p.plan, on, "");
}

void Checkpointer::save_in_background(std::unique_ptr<storage::Writer> writer, const DistributedState& state,
                                      const std::shared_ptr<BackgroundJob>& job, const BackgroundOptions& options) {
  auto g = group();
  const std::string context = writer->context();
  DTRAIN_CHECK_ARG(g->rank() >= 0, context, ": this rank is not in the group");
  wait_for(writer->lane(), context);
  Lane& l = lane(writer->lane());
  l.join();  // done: wait_for saw it
  auto on = companion(l, options, context);
  auto planned = std::make_shared<Planned>(plan_and_prepare(*writer, g, state));
  // A rank that cannot stage still takes part in the write's first
  // agreement, so that every rank fails with its error. The lane's buffers
  // are the thread's until it is joined (the lane's next save).
  auto stage = [&l, reuse = options.reuse_staging, die = options.die_while_staging, planned] {
    return dtrain::detail::error_of([&] { staging::stage(planned->part, l.buffers, reuse, die); });
  };
  const bool in_background = options.stage_in_background;
  std::string staging_error = in_background ? std::string() : stage();
  auto order = in_background ? std::make_shared<staging::CallersStreams>(planned->part) : nullptr;
  if (!in_background) job->mark_staged();
  l.pending = job;
  l.thread = std::thread([writer = std::move(writer), on, planned, job, staging_error, in_background, stage,
                          order]() mutable {
    if (in_background) {  // at training's priority: its next step waits for it
      order->order_this_thread();
      staging_error = stage();
      job->mark_staged();
    }
    background::lower_this_threads_priority();
    std::exception_ptr error;
    try {
      job->written = writer->write(planned->part, planned->plan, on, staging_error);
    } catch (...) {
      error = std::current_exception();
    }
    planned.reset();  // the staged part goes before the job is seen done
    job->finish(error);
  });
}

}  // namespace dtrain::checkpoint
