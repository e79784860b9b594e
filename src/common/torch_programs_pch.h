// Precompiled once for the examples, benchmarks and tests
// (dtrain_programs_pch in CMakeLists.txt): all of libtorch's C++ front end.
#include <torch/torch.h>
