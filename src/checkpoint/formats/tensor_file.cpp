#include "dtrain/checkpoint/tensor_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "checkpoint/formats/dtype_table.h"
#include "checkpoint/formats/file_reader.h"
#include "checkpoint/formats/tensor_file_format.h"
#include "common/durable_file.h"
#include "common/enforce.h"

namespace dtrain::checkpoint {
namespace {

namespace tf = tensor_file;

constexpr std::pair<at::ScalarType, tf::DType> kTypes[] = {
    {at::kFloat, tf::DType::Float32},       {at::kDouble, tf::DType::Float64},
    {at::kHalf, tf::DType::Float16},        {at::kBFloat16, tf::DType::BFloat16},
    {at::kLong, tf::DType::Int64},          {at::kInt, tf::DType::Int32},
    {at::kShort, tf::DType::Int16},         {at::kChar, tf::DType::Int8},
    {at::kByte, tf::DType::UInt8},          {at::kBool, tf::DType::Bool},
    {at::kComplexFloat, tf::DType::Complex64}, {at::kComplexDouble, tf::DType::Complex128},
};

tf::DType to_file(const std::string& name, at::ScalarType type) {
  if (const auto file_type = file_type_of(kTypes, type)) return *file_type;
  throw InvalidArgument(::dtrain::detail::cat("tensor file: tensor ", name, " has the dtype ", type,
                                    ", which tensor files do not store"));
}

at::ScalarType to_torch(tf::DType type) {
  const auto torch_type = torch_type_of(kTypes, type);
  DTRAIN_ENFORCE(torch_type.has_value());
  return *torch_type;
}

// The bytes to write: contiguous and on the CPU (a copy only when needed).
at::Tensor host_bytes(const std::string& name, const at::Tensor& t) {
  DTRAIN_CHECK_ARG(t.defined(), "tensor file: tensor ", name, " is undefined");
  DTRAIN_CHECK_ARG(t.layout() == at::kStrided && !t.is_quantized(), "tensor file: tensor ", name,
                   " is not a dense tensor (layout ", t.layout(), ")");
  return t.detach().to(at::kCPU).contiguous();
}

// The header of `file`'s tensors, their offsets assigned; returns the
// data's size.
uint64_t build_header(const TensorFile& file, tf::Header& header) {
  for (const auto& [key, value] : file.metadata) header.metadata.emplace_back(key, value);
  for (const auto& [name, tensor] : file.tensors) {
    const at::Tensor bytes = host_bytes(name, tensor);
    tf::Entry e;
    e.name = name;
    e.dtype = to_file(name, bytes.scalar_type());
    e.shape = bytes.sizes().vec();
    e.bytes = bytes.nbytes();
    e.crc = tf::crc32(bytes.data_ptr(), bytes.nbytes());
    header.tensors.push_back(std::move(e));
  }
  return tf::assign_offsets(header);
}

}  // namespace

std::string encode_tensor_file(const TensorFile& file) {
  tf::Header header;
  const uint64_t data_bytes = build_header(file, header);
  std::string out = tf::encode_prefix(header, data_bytes);
  out.reserve(out.size() + data_bytes);
  for (const auto& [name, tensor] : file.tensors) {
    const at::Tensor bytes = host_bytes(name, tensor);
    out.append(static_cast<const char*>(bytes.data_ptr()), bytes.nbytes());
  }
  return out;
}

TensorFile decode_tensor_file(const std::string& bytes, const std::string& what) {
  const tf::Layout layout = tf::read_layout(what, bytes.size(), [&](uint64_t offset, size_t n, void* out) {
    DTRAIN_CHECK_ARG(offset <= bytes.size() && n <= bytes.size() - offset, what, ": ends at byte ",
                     bytes.size(), ", before byte ", offset + n);
    std::memcpy(out, bytes.data() + offset, n);
  });
  TensorFile result;
  for (const auto& [key, value] : layout.header.metadata) result.metadata[key] = value;
  for (const auto& e : layout.header.tensors) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(to_torch(e.dtype)));
    DTRAIN_ENFORCE_EQ(t.nbytes(), e.bytes);
    const char* data = bytes.data() + layout.data_start + e.offset;  // within: read_layout checked
    tf::verify(what, e, data);
    std::memcpy(t.data_ptr(), data, e.bytes);
    DTRAIN_CHECK_ARG(result.tensors.emplace(e.name, t).second, what, ": names tensor ", e.name, " twice");
  }
  return result;
}

void save_tensor_file(const std::string& path, const TensorFile& file, const WriteFaults& faults) {
  tf::Header header;
  const uint64_t data_bytes = build_header(file, header);
  const std::string prefix = tf::encode_prefix(header, data_bytes);
  ::dtrain::files::WriteFaults hooks;
  hooks.die_while_writing = faults.die_while_writing;
  hooks.fsync_errno = faults.fsync_errno;
  try {
    ::dtrain::files::replace_durably(path, prefix.size() + data_bytes, [&](::dtrain::files::Sink& out) {
      out.write(prefix.data(), prefix.size());
      for (const auto& [name, tensor] : file.tensors) {
        const at::Tensor bytes = host_bytes(name, tensor);
        out.write(bytes.data_ptr(), bytes.nbytes());
      }
    }, hooks);
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Error& e) {
    throw Error("cannot save tensor file " + path + ": " + e.what());
  }
}

struct TensorFileReader::Impl {
  std::string what;
  tensor_file_io::File in;
  tf::Layout layout;
  std::map<std::string, size_t> index;
  Impl(const std::string& path) : what("tensor file " + path), in(what, path) {
    layout = tf::read_layout(what, in.size(),
                             [&](uint64_t offset, size_t n, void* out) { in.read(offset, n, out); });
    for (size_t i = 0; i < layout.header.tensors.size(); ++i) index[layout.header.tensors[i].name] = i;
  }
  const tf::Entry& entry(const std::string& name) const {
    auto it = index.find(name);
    DTRAIN_CHECK_ARG(it != index.end(), what, ": has no tensor ", name);
    return layout.header.tensors[it->second];
  }
};

TensorFileReader::TensorFileReader(const std::string& path) : impl_(std::make_unique<Impl>(path)) {
  for (const auto& [key, value] : impl_->layout.header.metadata) metadata_[key] = value;
}

TensorFileReader::~TensorFileReader() = default;

bool TensorFileReader::contains(const std::string& name) const { return impl_->index.count(name) > 0; }

std::vector<std::string> TensorFileReader::names() const {
  std::vector<std::string> out;
  for (const auto& e : impl_->layout.header.tensors) out.push_back(e.name);
  return out;
}

std::vector<int64_t> TensorFileReader::shape(const std::string& name) const {
  return impl_->entry(name).shape;
}

at::ScalarType TensorFileReader::dtype(const std::string& name) const {
  return to_torch(impl_->entry(name).dtype);
}

at::Tensor TensorFileReader::read(const std::string& name) const {
  const auto& e = impl_->entry(name);
  // e.bytes is within the file's size: read_layout checked it.
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(to_torch(e.dtype)));
  DTRAIN_ENFORCE_EQ(t.nbytes(), e.bytes);
  impl_->in.read(impl_->layout.data_start + e.offset, static_cast<size_t>(e.bytes), t.data_ptr());
  tf::verify(impl_->what, e, t.data_ptr());
  return t;
}

TensorFile load_tensor_file(const std::string& path) {
  TensorFileReader reader(path);
  TensorFile result;
  result.metadata = reader.metadata();
  for (const auto& name : reader.names()) result.tensors.emplace(name, reader.read(name));
  return result;
}

}  // namespace dtrain::checkpoint
