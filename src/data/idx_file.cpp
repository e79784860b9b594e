#include "data/idx_file.h"

namespace dtrain::data {

at::Tensor read_idx_gz(const std::string& path, const IdxSpec& spec) {
  at::Tensor data;
  read_idx_gz(path, spec, [&](const std::vector<int64_t>& shape) {
    data = at::empty(shape, at::TensorOptions().dtype(at::kByte));
    return data.data_ptr<uint8_t>();
  });
  return data;
}

}  // namespace dtrain::data
