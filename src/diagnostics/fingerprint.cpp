#include "diagnostics/fingerprint.h"

#include <cstring>
#include <sstream>

#include "common/enforce.h"

namespace dtrain {
namespace {

constexpr int64_t kFingerprintMagic = 0x64747266;  // "dtrf"
constexpr int kWidth = 16;
constexpr int kFingerprintMaxDims = 7;
const char* const kOps[] = {"all_reduce", "broadcast",      "reduce",     "all_gather", "gather",
                            "scatter",    "reduce_scatter", "all_to_all", "barrier"};
const char* const kReduceOps[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};

int64_t fingerprint_op_index(const char* op) {
  for (size_t i = 0; i < sizeof(kOps) / sizeof(kOps[0]); ++i)
    if (std::strcmp(kOps[i], op) == 0) return static_cast<int64_t>(i);
  return -1;
}

// Layout: magic, seq, op, dtype, root, reduce op, ndim, numel, sizes...
std::string describe_fingerprint(const int64_t* f) {
  std::vector<std::string> parts;
  if (f[3] >= 0) {
    std::ostringstream shape;
    shape << "shape [";
    for (int64_t d = 0; d < std::min<int64_t>(f[6], kFingerprintMaxDims); ++d) {
      shape << (d ? ", " : "") << f[8 + d];
    }
    shape << (f[6] > kFingerprintMaxDims ? ", ...]" : "]");
    parts.push_back(detail::cat("dtype ", static_cast<at::ScalarType>(f[3])));
    parts.push_back(shape.str());
  }
  if (f[4] >= 0) parts.push_back(detail::cat("root ", f[4]));
  if (f[5] >= 0 && f[5] < 5) parts.push_back(detail::cat("op ", kReduceOps[f[5]]));
  std::ostringstream out;
  out << (f[2] >= 0 && f[2] < 9 ? kOps[f[2]] : "?") << " #" << f[1];
  if (!parts.empty()) out << " (" << detail::join(parts) << ")";
  return out.str();
}

}  // namespace

at::Tensor make_fingerprint(const char* op, uint64_t seq, const at::Tensor& tensor, int64_t root,
                            int64_t reduce_op) {
  auto row = at::full({kWidth}, -1, at::kLong);
  auto* f = row.data_ptr<int64_t>();
  f[0] = kFingerprintMagic;
  f[1] = static_cast<int64_t>(seq);
  f[2] = fingerprint_op_index(op);
  if (tensor.defined()) {
    f[3] = static_cast<int64_t>(tensor.scalar_type());
    f[6] = tensor.dim();
    f[7] = tensor.numel();
    for (int64_t d = 0; d < std::min<int64_t>(tensor.dim(), kFingerprintMaxDims); ++d) {
      f[8 + d] = tensor.size(d);
    }
  }
  f[4] = root;
  f[5] = reduce_op;
  return row;
}

void compare_fingerprints(const std::string& group, uint64_t seq,
                          const std::vector<at::Tensor>& rows) {
  const auto* first = rows[0].data_ptr<int64_t>();
  bool same = true;
  for (const auto& row : rows)
    same = same && std::memcmp(row.data_ptr<int64_t>(), first, kWidth * sizeof(int64_t)) == 0;
  if (same) return;
  std::ostringstream out;
  out << "DTRAIN_DEBUG=DETAIL: ranks of group '" << group << "' called different collectives at call #"
      << seq << ":";
  for (size_t r = 0; r < rows.size(); ++r) {
    out << "\n  rank " << r << ": " << describe_fingerprint(rows[r].data_ptr<int64_t>());
  }
  out << "\nEvery rank must issue the same collectives, in the same order, on tensors of the same "
         "dtype and shape.";
  throw CollectiveMismatch(out.str());
}

}  // namespace dtrain
