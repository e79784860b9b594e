#pragma once

// CPU memory for FSDP's large transient buffers (a unit's gathered full
// parameters, its flat gradient), mapped when allocated and unmapped when
// freed. Under DTRAIN_CPU_MEMORY=cache malloc keeps what a process frees,
// and blocks of every size and lifetime share its heap, so the heap grows
// past what is live at once: FSDP, whose point is to hold one unit in full
// at a time, would then keep the memory of many. Buffers from here go back
// to the system the moment FSDP frees them, whatever malloc does.

#include <ATen/ATen.h>

#include <cstddef>

namespace dtrain::fsdp {

// Buffers at least this large are mapped; smaller ones come from the
// device's allocator as before.
inline constexpr size_t kMappedMinBytes = size_t{1} << 20;

// `bytes` for `storage`: mapped memory (zeroed by the kernel) for a large
// CPU storage, else from the storage's own allocator.
at::DataPtr allocate_transient(size_t bytes, const c10::Storage& storage, const c10::Device& device);
// A new 1-D tensor of zeros, its memory from allocate_transient.
at::Tensor transient_zeros(int64_t numel, const at::TensorOptions& options);

}  // namespace dtrain::fsdp
