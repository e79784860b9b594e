#pragma once

// How freed CPU tensor memory is handled in a training process.
//
// libtorch allocates CPU tensors with the C allocator. glibc hands large
// blocks (activations, im2col buffers, gradients: megabytes each) back to
// the kernel as soon as they are freed, so every training step maps them
// again and page-faults them in, page by page, zeroed by the kernel. On the
// MNIST convnet that is ~11,500 faults a step, 15-35% of the step time.
//
// DTRAIN_CPU_MEMORY=cache (the default) keeps freed memory in the process
// for the next step, as PyTorch's CUDA caching allocator does on the GPU:
// malloc's mmap threshold is raised to the largest value glibc accepts
// (1 GiB on Debian 12's glibc 2.36; 32 MiB on older glibc, which refuses
// more), so blocks below it come from malloc's heap instead of their own
// mapping, and the heap is never trimmed. The process's resident size stays
// at its peak. A threshold the user set (MALLOC_MMAP_THRESHOLD_,
// MALLOC_TRIM_THRESHOLD_, or their glibc.malloc.* entries in GLIBC_TUNABLES)
// is left as set; when the user set any malloc variable, one line on stderr
// says what is in force (otherwise it is logged at DTRAIN_DEBUG=INFO).
// DTRAIN_CPU_MEMORY=system leaves malloc exactly as configured (by glibc's
// defaults or the user's GLIBC_TUNABLES / MALLOC_*_ variables).

#include <string>

namespace dtrain::detail {

// Applies DTRAIN_CPU_MEMORY, once per process (later calls return the same
// answer). Called by init_process_group(), DistributedDataParallel and
// DataParallel. Returns the policy in force: "cache" or "system". A bad
// value throws InvalidArgument naming the variable.
const std::string& apply_cpu_memory_policy();

// For sharded training (FSDP), whose point is to hold little at once: under
// the cache policy, blocks of at least `bytes` get their own mapping again,
// returned to the system when freed (as glibc's defaults do above 32 MiB),
// so that the heap keeps only smaller ones. Nothing when the policy is
// system or the user set the mmap threshold. Applies the policy first.
void return_large_blocks(int bytes);

}  // namespace dtrain::detail
