#pragma once

// DTRAIN_DEBUG=DETAIL: before a collective runs, each rank all-gathers a
// fixed-size int64 fingerprint of its call (sequence number, op, dtype,
// shape, root, reduce op). The fingerprint exchange itself always has the
// same shape, so it cannot mismatch; when the calls differ every rank sees
// the same table and raises the same CollectiveMismatch.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

at::Tensor make_fingerprint(const char* op, uint64_t seq, const at::Tensor& tensor, int64_t root,
                            int64_t reduce_op);
// Throws CollectiveMismatch when the rows differ.
void compare_fingerprints(const std::string& group, uint64_t seq,
                          const std::vector<at::Tensor>& rows);

}  // namespace dtrain
