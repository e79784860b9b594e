#pragma once

// Tensor files: named tensors and string metadata in a format with no code
// paths (no pickle, no TorchScript): a validated header and raw bytes with
// a checksum per tensor, the idea of safetensors. Reading checks every size
// against the file before allocating anything, so a damaged or hostile file
// is refused with an error naming the file and the problem, at a memory
// cost of at most its own size. docs/tensor-file.md has the layout.
//
//   dtrain::checkpoint::TensorFile f;
//   f.tensors["fc.weight"] = model->fc->weight;
//   f.metadata["epoch"] = "3";
//   dtrain::checkpoint::save_tensor_file("model.dtt", f);
//   auto back = dtrain::checkpoint::load_tensor_file("model.dtt");

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::checkpoint {

struct TensorFile {
  std::map<std::string, at::Tensor> tensors;  // dense tensors of any device
  std::map<std::string, std::string> metadata;
};

// Test hooks for the crash-safety tests; leave them at their defaults.
struct WriteFaults {
  bool die_while_writing = false;  // the writer SIGKILLs itself half way through
  int fsync_errno = 0;             // nonzero: the fsync of the temporary file fails with it
};

// Writes `path` atomically and durably: to `<path>.tmp`, fsync, rename,
// fsync of the directory; after a crash `path` holds the previous file or
// the new one, never a mix. Tensors are stored as contiguous CPU bytes
// (CUDA tensors are copied to the host). Throws dtrain::InvalidArgument for
// what cannot be stored (an undefined, sparse or quantized tensor, an
// unsupported dtype, an empty name) and dtrain::Error "cannot save tensor
// file <path>: cannot <step> <file>: <reason>" when a step fails; `path` is
// then untouched and no temporary file stays behind.
void save_tensor_file(const std::string& path, const TensorFile& file,
                      const WriteFaults& faults = {});

// Reads and verifies the whole file: CPU tensors of the stored dtypes and
// shapes. Throws dtrain::InvalidArgument "tensor file <path>: <problem>"
// for a missing, truncated, damaged or hostile file.
TensorFile load_tensor_file(const std::string& path);

// The same format in memory: the bytes save_tensor_file would write, and
// those bytes read back with every check load_tensor_file makes (errors
// InvalidArgument "<what>: <problem>").
std::string encode_tensor_file(const TensorFile& file);
TensorFile decode_tensor_file(const std::string& bytes, const std::string& what);

// Reads a tensor file piecewise: the header is read and checked when it is
// opened, each tensor (and its checksum) only when asked for. Errors as
// load_tensor_file's.
class TensorFileReader {
 public:
  explicit TensorFileReader(const std::string& path);
  ~TensorFileReader();
  TensorFileReader(const TensorFileReader&) = delete;
  TensorFileReader& operator=(const TensorFileReader&) = delete;

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;  // in file order
  // The tensor's shape without reading it.
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  at::Tensor read(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dtrain::checkpoint
