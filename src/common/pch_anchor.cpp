// The source of dtrain_programs_pch, the target that owns the precompiled
// <torch/torch.h> the examples, benchmarks and tests reuse (CMakeLists.txt).
