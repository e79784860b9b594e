#include "dtrain/launch_env.h"

#include <unistd.h>

#include <climits>

#include "common/env.h"

namespace dtrain {

int restart_count() {
  return static_cast<int>(env::get_int(env::kRestartCount, 0, INT_MAX).value_or(0));
}

int local_rank() { return static_cast<int>(env::get_int(env::kLocalRank, 0, INT_MAX).value_or(0)); }

bool console_is_terminal() {
  return isatty(STDOUT_FILENO) == 1 || env::get(env::kTty).value_or("0") == "1";
}

}  // namespace dtrain
