# A PyTorch program as dtrain-run's worker: torch.distributed's env://
# rendezvous must find dtrain-run's store on MASTER_PORT (the agent store,
# TORCHELASTIC_USE_AGENT_STORE=True), as it finds torchrun's.
import os

import no_libuv  # noqa: F401  (Debian's 2.6 and 2.14 with USE_LIBUV=0; see there)
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
dist.barrier()
print(f"rank {rank} sum {int(t[0])} world {world} port {os.environ['MASTER_PORT']} "
      f"agent {os.environ['TORCHELASTIC_USE_AGENT_STORE']}", flush=True)
dist.destroy_process_group()
