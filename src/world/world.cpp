// The process-wide default group (torch.distributed's "world") and
// new_group. Groups themselves hold no global state; only this file does, so
// tests can run many groups side by side in one process.

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "common/cpu_memory.h"
#include "common/enforce.h"
#include "core/backend_registry.h"
#include "diagnostics/error_file.h"
#include "diagnostics/timeline.h"
#include "world/companion_group.h"
#include "world/rendezvous.h"
#include "dtrain/distributed.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/store/prefix_store.h"

namespace dtrain {
namespace {

// Stand-in handed to ranks outside a new_group: its checks reject every
// call before a backend hook could run.
class NonMemberGroup final : public ProcessGroup {
 public:
  NonMemberGroup(int size, GroupOptions options) : ProcessGroup(-1, size, std::move(options)) {}
  std::string backend_name() const override { return "none (not a member)"; }
  bool supports(c10::DeviceType) const override { return true; }

 protected:
  WorkPtr post(const Call&, Op) override {
    throw InternalError("NonMemberGroup: an operation reached the backend");
  }
};

struct World {
  std::mutex mutex;
  std::shared_ptr<ProcessGroup> group;
  std::shared_ptr<Store> store;
  std::string backend;
  std::string local_address;
  int device_id = -1;
  int next_group_id = 1;
  std::map<std::string, int> companions;  // made so far, by "<group>/<purpose>"
  bool initializing = false;  // an init_process_group is under way
};

World& world() {
  static World w;
  return w;
}

std::shared_ptr<ProcessGroup> require_default(World& w) {
  if (!w.group)
    throw InvalidArgument(
        "the default process group is not initialized; call dtrain::init_process_group() first");
  return w.group;
}

}  // namespace

// The rendezvous and the backend's factory run outside the world's mutex:
// they block for as long as peers take to arrive, and a factory may itself
// ask is_initialized() or get_rank() (which take the mutex).
void init_process_group(const InitOptions& options) {
  detail::install_error_file_handler();  // a worker's uncaught exception reaches its launcher
  auto& w = world();
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    DTRAIN_CHECK_ARG(!w.group && !w.initializing,
                     "init_process_group: the default process group is already initialized; call "
                     "destroy_process_group() first");
    w.initializing = true;
  }
  struct Done {
    World& w;
    ~Done() {
      std::lock_guard<std::mutex> lock(w.mutex);
      w.initializing = false;
    }
  } done{w};
  detail::apply_cpu_memory_policy();
  Rendezvous r;
  const auto own_world = options.store() ? nullptr : detail::own_world(options.backend());
  if (options.backend() == "mpi" && !options.store() && !own_world) {
    r.rank = 0, r.world_size = 1;  // not built: create_process_group explains why
    r.timeout = resolve_timeout(options);
    r.store = std::make_shared<HashStore>(r.timeout);
  } else if (own_world) {
    // MPI needs no store: rank and size come from mpirun. The group's store
    // is a process-local one (new_group and user keys still work locally).
    std::tie(r.rank, r.world_size) = own_world();
    DTRAIN_CHECK_ARG(options.rank() < 0 || options.rank() == r.rank, "init_process_group: rank ",
                     options.rank(), " was given, but MPI has this process as rank ", r.rank);
    DTRAIN_CHECK_ARG(options.world_size() < 0 || options.world_size() == r.world_size,
                     "init_process_group: world_size ", options.world_size(),
                     " was given, but MPI's world has ", r.world_size, " processes");
    r.timeout = resolve_timeout(options);
    r.store = std::make_shared<HashStore>(r.timeout);
  } else {
    r = rendezvous(options);
  }
  detail::timeline::set_rank(r.rank);  // names this process's timeline file
  auto group = create_process_group(
      options.backend(), std::make_shared<PrefixStore>("default", r.store), r.rank, r.world_size,
      GroupOptions()
          .name("default")
          .timeout(r.timeout)
          .local_address(r.local_address)
          .device_id(options.device_id()));
  std::lock_guard<std::mutex> lock(w.mutex);
  w.group = std::move(group);
  w.store = r.store;
  w.backend = options.backend();
  w.local_address = r.local_address;
  w.device_id = options.device_id();
  w.next_group_id = 1;
  w.companions.clear();
}

bool is_initialized() {
  auto& w = world();
  std::lock_guard<std::mutex> lock(w.mutex);
  return static_cast<bool>(w.group);
}

void destroy_process_group() {
  auto& w = world();
  std::shared_ptr<ProcessGroup> group;
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    group = std::move(w.group);
    w.store.reset();
  }
  // The group's destructor drains its queue outside the lock.
}

int get_rank() {
  auto& w = world();
  std::lock_guard<std::mutex> lock(w.mutex);
  return require_default(w)->rank();
}

int get_world_size() {
  auto& w = world();
  std::lock_guard<std::mutex> lock(w.mutex);
  return require_default(w)->size();
}

std::shared_ptr<ProcessGroup> default_group() {
  auto& w = world();
  std::lock_guard<std::mutex> lock(w.mutex);
  return require_default(w);
}

std::shared_ptr<Store> default_store() {
  auto& w = world();
  std::lock_guard<std::mutex> lock(w.mutex);
  require_default(w);
  return w.store;
}

std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks,
                                        const NewGroupOptions& options) {
  auto& w = world();
  std::unique_lock<std::mutex> lock(w.mutex);
  auto world_group = require_default(w);
  const int world_size = world_group->size();
  DTRAIN_CHECK_ARG(!ranks.empty(), "new_group: ranks is empty");
  std::set<int> unique(ranks.begin(), ranks.end());
  DTRAIN_CHECK_ARG(unique.size() == ranks.size(), "new_group: ranks [", detail::join(ranks),
                   "] contain duplicates");
  DTRAIN_CHECK_ARG(*unique.begin() >= 0 && *unique.rbegin() < world_size, "new_group: ranks [",
                   detail::join(ranks), "] must lie in 0..", world_size - 1);
  std::vector<int> sorted(unique.begin(), unique.end());
  const auto name = "group_" + std::to_string(w.next_group_id++);
  auto opts = GroupOptions()
                  .name(name)
                  .timeout(options.timeout().value_or(world_group->timeout()))
                  .local_address(w.local_address)
                  .device_id(w.device_id)
                  .global_ranks(sorted);
  const int me = world_group->rank();
  auto it = std::find(sorted.begin(), sorted.end(), me);
  if (it == sorted.end())
    return std::make_shared<NonMemberGroup>(static_cast<int>(sorted.size()), opts);
  const auto backend = options.backend().empty() ? w.backend : options.backend();
  auto store = std::make_shared<PrefixStore>(name, w.store);
  lock.unlock();  // the factory may call get_rank() and friends
  return create_process_group(backend, std::move(store),
                              static_cast<int>(it - sorted.begin()),
                              static_cast<int>(sorted.size()), opts);
}

std::shared_ptr<ProcessGroup> detail::new_companion_group(const ProcessGroup& group,
                                                          const std::string& purpose,
                                                          const std::string& caller) {
  auto& w = world();
  std::unique_lock<std::mutex> lock(w.mutex);
  DTRAIN_CHECK_ARG(w.group, caller, " needs a process group of its own beside '", group.name(),
                   "', made over the default group's store: call dtrain::init_process_group first, "
                   "or give it one");
  DTRAIN_CHECK_ARG(group.rank() >= 0, caller, ": this rank is not in group '", group.name(), "'");
  const auto base = group.name() + "/" + purpose;
  const auto name = base + "/" + std::to_string(++w.companions[base]);
  auto opts = GroupOptions()
                  .name(name)
                  .timeout(group.timeout())
                  .local_address(w.local_address)
                  .global_ranks(group.global_ranks());
  auto store = std::make_shared<PrefixStore>(name, w.store);
  lock.unlock();
  return create_process_group("tcp", std::move(store), group.rank(), group.size(), opts);
}

std::pair<std::shared_ptr<ProcessGroup>, std::vector<std::shared_ptr<ProcessGroup>>> new_subgroups(
    int group_size, const NewGroupOptions& options) {
  const int world_size = get_world_size();
  DTRAIN_CHECK_ARG(group_size > 0 && group_size <= world_size, "new_subgroups: group_size ",
                   group_size, " must lie in 1..", world_size, " (the world size)");
  DTRAIN_CHECK_ARG(world_size % group_size == 0, "new_subgroups: the world size ", world_size,
                   " is not divisible by group_size ", group_size);
  std::vector<std::vector<int>> lists(world_size / group_size);
  for (int r = 0; r < world_size; ++r) lists[r / group_size].push_back(r);
  return new_subgroups_by_enumeration(lists, options);
}

std::pair<std::shared_ptr<ProcessGroup>, std::vector<std::shared_ptr<ProcessGroup>>>
new_subgroups_by_enumeration(const std::vector<std::vector<int>>& ranks_per_subgroup,
                             const NewGroupOptions& options) {
  DTRAIN_CHECK_ARG(!ranks_per_subgroup.empty(),
                   "new_subgroups_by_enumeration: ranks_per_subgroup is empty");
  std::set<int> seen;
  for (const auto& list : ranks_per_subgroup)
    for (int r : list)
      DTRAIN_CHECK_ARG(seen.insert(r).second, "new_subgroups_by_enumeration: rank ", r,
                       " is in more than one subgroup");
  const int me = get_rank();
  std::shared_ptr<ProcessGroup> mine;
  std::vector<std::shared_ptr<ProcessGroup>> all;
  for (const auto& list : ranks_per_subgroup) {
    all.push_back(new_group(list, options));
    if (std::find(list.begin(), list.end(), me) != list.end()) mine = all.back();
  }
  return {mine, all};
}

}  // namespace dtrain
