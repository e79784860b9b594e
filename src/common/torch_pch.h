// Precompiled once per target (CMake target_precompile_headers).
#include <ATen/ATen.h>
