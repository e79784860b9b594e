#pragma once

// A distributed save in two halves. prepare_save is collective over the
// saving group and decides who writes what (the plan), the checkpoint's
// token and this rank's tensor file; write_and_commit writes that file and
// commits the checkpoint. save() runs both at once; async_save() runs the
// first, copies the file's tensors into its staging buffers, and hands the
// second to its background writer, whose collectives go over a group of
// their own (distributed_save.cpp, async_save.cpp).

#include <map>
#include <memory>
#include <string>

#include "checkpoint/save_plan.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/checkpoint/tensor_file.h"
#include "dtrain/process_group.h"

namespace dtrain::checkpoint::files {

struct SaveJob {
  std::string dir;
  std::string context;  // "checkpoint::save <dir>": what its errors start with
  SavePlan plan;
  std::string token;
  int rank = 0, world = 0;
  // This rank's data file: views of the state (save) or staged copies.
  TensorFile mine;
  std::map<std::string, std::string> metadata;  // the user's; rank 0 writes its own
  WriteFaults faults;
  bool die_before_commit = false;
};

// Collective over `group`: waits for the group's asynchronous save in
// flight (wait_for_async_save), checks the state (InvalidArgument, the same
// on every rank, as save() documents), plans, draws the token. `context`
// is "checkpoint::save" or "checkpoint::async_save"; the test hooks go into
// the job.
SaveJob prepare_save(const std::string& dir, const DistributedState& state,
                     const std::shared_ptr<ProcessGroup>& group, const std::string& context,
                     const WriteFaults& faults, bool die_before_commit);

// Collective over `group` (the saving group's ranks, in its order): makes
// the directory, writes this rank's file durably, then rank 0 commits. Any
// rank's failure, `prior_error` included (this rank's failure before it
// got here, such as staging), makes every rank throw the same Error.
void write_and_commit(const SaveJob& job, ProcessGroup& group, const std::string& prior_error = "");

// Waits for `group`'s asynchronous save in flight, if any; throws its
// failure when nobody has seen it yet (async_save.cpp). save() and
// async_save() call it first: at most one save of a group is in flight.
void wait_for_async_save(const std::shared_ptr<ProcessGroup>& group, const std::string& context);

}  // namespace dtrain::checkpoint::files
