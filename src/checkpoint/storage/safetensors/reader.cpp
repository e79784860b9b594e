#include "checkpoint/storage/safetensors/reader.h"

#include <algorithm>

#include "checkpoint/formats/dtype_table.h"
#include "checkpoint/formats/file_reader.h"
#include "common/enforce.h"
#include "common/paths.h"
#include "dtrain/errors.h"

namespace dtrain::checkpoint::detail {
namespace {

namespace st = safetensors;

constexpr std::pair<at::ScalarType, st::DType> kTypes[] = {
    {at::kBool, st::DType::Bool},       {at::kByte, st::DType::UInt8},     {at::kChar, st::DType::Int8},
    {at::kShort, st::DType::Int16},     {at::kInt, st::DType::Int32},      {at::kLong, st::DType::Int64},
    {at::kHalf, st::DType::Float16},    {at::kBFloat16, st::DType::BFloat16},
    {at::kFloat, st::DType::Float32},   {at::kDouble, st::DType::Float64},
};

std::atomic<uint64_t> bytes_read{0};

}  // namespace

at::ScalarType torch_type(st::DType type) {
  const auto t = torch_type_of(kTypes, type);
  DTRAIN_ENFORCE(t.has_value());
  return *t;
}

st::DType file_type(const std::string& entry, at::ScalarType type) {
  if (const auto t = file_type_of(kTypes, type)) return *t;
  throw InvalidArgument(dtrain::detail::cat("export_safetensors: '", entry, "' is ", type,
                                            ", which safetensors files do not hold here"));
}

uint64_t safetensors_bytes_read() { return bytes_read.load(); }

struct SafetensorsFiles::Opened {
  std::string path;
  tensor_file_io::File in;
  st::Layout layout;
  explicit Opened(const std::string& p) : path(p), in("safetensors " + p, p) {
    layout = st::read_layout(p, in.size(), [&](uint64_t offset, size_t n, void* out) { in.read(offset, n, out); });
  }
  void read(uint64_t offset_in_data, size_t n, void* out) {
    in.read(layout.data_start + offset_in_data, n, out);
    bytes_read += n;
  }
};

SafetensorsFiles::SafetensorsFiles(const std::string& dir) : dir_(dir) {
  std::vector<std::string> names = paths::list(dir);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    if (name.size() < 12 || name.compare(name.size() - 12, 12, ".safetensors") != 0) continue;
    auto f = std::make_unique<Opened>(paths::join(dir, name));
    for (size_t i = 0; i < f->layout.tensors.size(); ++i) {
      const auto& t = f->layout.tensors[i];
      const auto [at, fresh] = where_.emplace(t.name, std::make_pair(opened_.size(), i));
      DTRAIN_CHECK_ARG(fresh, "import_safetensors ", dir, ": tensor '", t.name, "' is in both ",
                       opened_[at->second.first]->path, " and ", f->path,
                       " (files of two exports: was one interrupted? export again)");
    }
    opened_.push_back(std::move(f));
  }
  DTRAIN_CHECK_ARG(!opened_.empty(), "import_safetensors: no .safetensors file in ", dir);
}

SafetensorsFiles::~SafetensorsFiles() = default;

std::pair<SafetensorsFiles::Opened&, const st::Entry&> SafetensorsFiles::find(const std::string& name,
                                                                              const std::string& entry) {
  const auto it = where_.find(name);
  DTRAIN_CHECK_ARG(it != where_.end(), "import_safetensors ", dir_, ": no file has tensor '", name,
                   "' (for entry '", entry, "')");
  Opened& f = *opened_[it->second.first];
  return {f, f.layout.tensors[it->second.second]};
}

std::pair<SafetensorsFiles::Opened&, const st::Entry&> SafetensorsFiles::checked(const std::string& name,
                                                                                 const std::string& entry,
                                                                                 at::ScalarType dtype) {
  auto found = find(name, entry);
  DTRAIN_CHECK_ARG(torch_type(found.second.dtype) == dtype, "import_safetensors ", found.first.path, ": tensor '",
                   name, "' is ", st::dtype_name(found.second.dtype), " in the file but ", dtype, " here");
  return found;
}

const std::vector<int64_t>& SafetensorsFiles::shape(const std::string& name, const std::string& entry) {
  return find(name, entry).second.shape;
}

at::Tensor SafetensorsFiles::read_box(const std::string& name, const std::string& entry, at::ScalarType dtype,
                                      const std::vector<int64_t>& whole, const std::vector<int64_t>& offsets,
                                      at::IntArrayRef sizes) {
  auto [f, e] = checked(name, entry, dtype);
  DTRAIN_CHECK_ARG(e.shape == whole, "import_safetensors ", f.path, ": tensor '", name, "' has shape ",
                   at::IntArrayRef(e.shape), " in the file but ", at::IntArrayRef(whole), " here");
  DTRAIN_ENFORCE_EQ(offsets.size(), whole.size());
  DTRAIN_ENFORCE_EQ(sizes.size(), whole.size());
  at::Tensor out = at::empty(sizes, at::TensorOptions().dtype(dtype));
  const size_t elem = out.element_size();
  if (whole.empty()) {  // a scalar: its one element
    DTRAIN_ENFORCE_EQ(e.end - e.begin, elem);
    f.read(e.begin, elem, out.data_ptr());
    return out;
  }
  if (out.numel() == 0) return out;
  const int d = static_cast<int>(whole.size());
  // Runs: the dimensions after m are whole in the box, so each index of
  // dimensions 0..m-1 starts one run of sizes[m] x (their sizes) elements.
  int m = d - 1;
  while (m > 0 && sizes[m] == whole[m]) --m;
  std::vector<int64_t> stride(d, 1);  // of the whole, in elements
  for (int j = d - 2; j >= 0; --j) stride[j] = stride[j + 1] * whole[j + 1];
  const uint64_t run = static_cast<uint64_t>(sizes[m] * stride[m]) * elem;
  std::vector<int64_t> index(m, 0);  // within the box, dimensions 0..m-1
  auto* to = static_cast<char*>(out.data_ptr());
  for (;;) {
    int64_t at_element = offsets[m] * stride[m];
    for (int j = 0; j < m; ++j) at_element += (offsets[j] + index[j]) * stride[j];
    f.read(e.begin + static_cast<uint64_t>(at_element) * elem, run, to);
    to += run;
    int j = m - 1;
    while (j >= 0 && ++index[j] == sizes[j]) index[j--] = 0;
    if (j < 0) break;
  }
  return out;
}

at::Tensor SafetensorsFiles::read_range(const std::string& name, const std::string& entry, at::ScalarType dtype,
                                        int64_t numel, int64_t offset, int64_t count) {
  auto [f, e] = checked(name, entry, dtype);
  int64_t n = 1;
  for (int64_t s : e.shape) n *= s;
  DTRAIN_CHECK_ARG(n == numel, "import_safetensors ", dir_, ": tensor '", name, "' has ", n,
                   " elements in the file but ", numel, " here");
  DTRAIN_ENFORCE(offset >= 0 && count >= 0 && offset + count <= numel);
  at::Tensor out = at::empty({count}, at::TensorOptions().dtype(dtype));
  if (count > 0) f.read(e.begin + static_cast<uint64_t>(offset) * out.element_size(), out.nbytes(), out.data_ptr());
  return out;
}

}  // namespace dtrain::checkpoint::detail
