#pragma once

// Umbrella header: everything a training program needs.

#include "dtrain/checkpoint/distributed.h"
#include "dtrain/checkpoint/tensor_file.h"
#include "dtrain/data/distributed_sampler.h"
#include "dtrain/data_parallel.h"
#include "dtrain/ddp.h"
#include "dtrain/distributed.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/launch_env.h"
#include "dtrain/objects.h"
#include "dtrain/nn/sync_batch_norm.h"
#include "dtrain/optim/zero_redundancy_optimizer.h"
#include "dtrain/process_group.h"
#include "dtrain/store/file_store.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/store/prefix_store.h"
#include "dtrain/store/store.h"
#include "dtrain/store/tcp_store.h"
#include "dtrain/timeline.h"
#include "dtrain/work.h"
