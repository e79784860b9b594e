#pragma once

// import_safetensors' reading: the .safetensors files of a directory, their
// headers read and checked (safetensors_format.h), which file holds each
// tensor, and a tensor's part read alone: a box of it (row runs) or a flat
// range, never the whole tensor for a part, so a rank's memory is its
// share of the model, not the model.

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/formats/safetensors_format.h"

namespace dtrain::checkpoint::detail {

// The element types of the files beside torch's.
at::ScalarType torch_type(safetensors::DType type);
safetensors::DType file_type(const std::string& entry, at::ScalarType type);

class SafetensorsFiles {
 public:
  // Every *.safetensors file of `dir`, its header checked; a tensor in two
  // files is an InvalidArgument naming both.
  explicit SafetensorsFiles(const std::string& dir);
  ~SafetensorsFiles();

  // The shape tensor `name` (state entry `entry`) has in its file.
  const std::vector<int64_t>& shape(const std::string& name, const std::string& entry);
  // The box [offsets, offsets + sizes) of tensor `name`, whose dtype and
  // whole shape in the file must be `dtype` and `whole` (InvalidArgument
  // naming the file otherwise); offsets zero and sizes `whole`: all of it.
  at::Tensor read_box(const std::string& name, const std::string& entry, at::ScalarType dtype,
                      const std::vector<int64_t>& whole, const std::vector<int64_t>& offsets,
                      at::IntArrayRef sizes);
  // Elements [offset, offset + count) of tensor `name` flattened, whose
  // dtype must be `dtype` and element count `numel`.
  at::Tensor read_range(const std::string& name, const std::string& entry, at::ScalarType dtype,
                        int64_t numel, int64_t offset, int64_t count);

 private:
  struct Opened;
  std::pair<Opened&, const safetensors::Entry&> find(const std::string& name, const std::string& entry);
  std::pair<Opened&, const safetensors::Entry&> checked(const std::string& name, const std::string& entry,
                                                         at::ScalarType dtype);
  std::string dir_;
  std::vector<std::unique_ptr<Opened>> opened_;
  std::map<std::string, std::pair<size_t, size_t>> where_;  // tensor -> (file, index)
};

// Bytes of tensor data read by every SafetensorsFiles of this process so
// far (the import's test measures what a rank reads with it).
uint64_t safetensors_bytes_read();

}  // namespace dtrain::checkpoint::detail
