// rank_worker's checkpoint modes (rank_worker.cpp lists every mode).

#include <torch/torch.h>

#include <iostream>
#include <memory>
#include <string>

#include "dtrain/dtrain.h"
#include "harness/fsdp_models.h"
#include "rank_worker.h"

// Distributed checkpoints under a crash: `checkpoint-crash DIR PHASE`
// saves checkpoint 1 (the initial values) and dies (SIGKILL) while saving
// checkpoint 2: PHASE writing (in its data file) or commit (just before
// it), or async-staging, async-writing, async-commit (async_save: while
// copying the state, in the background writer's data file, before its
// commit; checkpoint 1 is saved asynchronously too). `checkpoint-check
// DIR` loads DIR into other values and checks that it holds checkpoint 1.
int checkpoint_crash(const std::string& dir, const std::string& phase, bool check) {
  namespace ckpt = dtrain::checkpoint;
  dtrain::init_process_group(dtrain::InitOptions().backend("tcp"));
  torch::manual_seed(check ? 5 : 0);
  dtrain::FullyShardedDataParallel fsdp(std::make_shared<dtrain::testing::ShardedMLPImpl>());
  torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(1e-2));
  ckpt::DistributedState state;
  ckpt::add_fsdp(state, fsdp, opt);
  if (check) {
    ckpt::load(dir, state);
    torch::manual_seed(0);
    auto initial = std::make_shared<dtrain::testing::ShardedMLPImpl>();
    const auto loaded = fsdp.full_state_dict();
    for (const auto& item : initial->named_parameters())
      if (!torch::equal(loaded.at(item.key()), item.value()))
        return fail("parameter " + item.key() + " is not checkpoint 1's");
    if (state.metadata.at("n") != "1") return fail("metadata n is " + state.metadata.at("n"));
    std::cout << "checkpoint 1 intact" << std::endl;
    return 0;
  }
  const bool async = phase.rfind("async-", 0) == 0;
  const std::string step = async ? phase.substr(6) : phase;
  state.metadata["n"] = "1";
  if (async)
    ckpt::async_save(dir, state).wait();
  else
    ckpt::save(dir, state);
  opt.zero_grad();
  fsdp.forward(torch::randn({4, 10})).sum().backward();
  opt.step();
  state.metadata["n"] = "2";
  const ckpt::WriteFaults die_writing{/*die_while_writing=*/true, 0};
  std::cout << "saving checkpoint 2" << std::endl;
  if (async) {
    auto options = ckpt::AsyncSaveOptions();
    if (step == "staging") options.die_while_staging(true);
    if (step == "writing") options.faults(die_writing);
    if (step == "commit") options.die_before_commit(true);
    ckpt::async_save(dir, state, options).wait();
  } else {
    ckpt::save(dir, state, step == "writing" ? ckpt::SaveOptions().faults(die_writing)
                                             : ckpt::SaveOptions().die_before_commit(true));
  }
  return fail("survived the fault");
}
