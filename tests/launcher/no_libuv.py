# Debian builds PyTorch 2.6 and 2.14 without libuv, yet two of its TCPStore
# callers still ask for libuv (the default since 2.4) whatever USE_LIBUV
# says: torchrun's rendezvous, and torch.distributed's env:// rendezvous as
# a client of a launcher's agent store (TORCHELASTIC_USE_AGENT_STORE=True).
# Both then fail with "use_libuv was requested but PyTorch was built without
# libuv support". Importing this module first makes use_libuv=False the
# default when USE_LIBUV=0 is set, where the binding has that argument; under
# PyTorch 1.13 (no such argument) it does nothing.
import os
import sys

import torch.distributed as dist

_TCPStore = dist.TCPStore
if os.environ.get("USE_LIBUV") == "0" and "use_libuv" in (_TCPStore.__init__.__doc__ or ""):

    def _tcp_store(*args, **kwargs):
        kwargs.setdefault("use_libuv", False)
        return _TCPStore(*args, **kwargs)

    dist.TCPStore = _tcp_store
    # torch.distributed's rendezvous module imported the class by name before
    # this ran. (sys.modules: the attribute torch.distributed.rendezvous is
    # that module's function of the same name, not the module.)
    sys.modules["torch.distributed.rendezvous"].TCPStore = _tcp_store
