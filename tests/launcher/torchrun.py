# PyTorch's torchrun, as the tests start it: torchrun's own main(), after
# no_libuv (see there), so that Debian's 2.6 and 2.14, built without libuv,
# start with USE_LIBUV=0. Under 1.13 this is plain torchrun.
import sys

import no_libuv  # noqa: F401  (before torchrun creates its store)
from torch.distributed.run import main

sys.exit(main())
