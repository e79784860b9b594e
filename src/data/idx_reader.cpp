#include "data/idx_reader.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/enforce.h"
#include "common/paths.h"

namespace dtrain::data {
namespace {

class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path) {
    DTRAIN_CHECK_ARG(paths::exists(path), path, ": no such file");
    DTRAIN_CHECK_ARG(!paths::is_directory(path), path,
                     ": is a directory, expected a gzip IDX file");
    errno = 0;
    file_ = gzopen(path.c_str(), "rb");
    DTRAIN_CHECK_ARG(file_ != nullptr, path, ": cannot open: ",
                     errno ? std::strerror(errno) : "out of memory");
    gzbuffer(file_, 1 << 18);  // fewer read() calls; the default is 8 KiB
  }
  ~GzReader() { gzclose(file_); }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to n bytes; fewer only at the end of the data. Corrupt gzip
  // data throws; a stream cut short ends the data (see truncated()).
  size_t read(void* out, size_t n) {
    auto* dst = static_cast<unsigned char*>(out);
    size_t done = 0;
    while (done < n) {
      // gzread takes an unsigned count and returns an int: read in chunks.
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
      const int got = gzread(file_, dst + done, chunk);
      if (got < 0) {
        int code = Z_OK;
        const char* message = gzerror(file_, &code);
        throw InvalidArgument(detail::cat(path_, ": corrupt gzip data (", message, ")"));
      }
      done += static_cast<size_t>(got);
      // zlib reports a mid-stream cut (Z_BUF_ERROR) and a bad CRC at the
      // end (Z_DATA_ERROR) through gzerror, often with a short but positive
      // read. Look now: zlib 1.3.2 clears a cut's error on the next gzread,
      // which then returns 0 as at a clean end.
      int code = Z_OK;
      const char* message = gzerror(file_, &code);
      if (code == Z_BUF_ERROR) truncated_ = true;
      else if (code != Z_OK)
        throw InvalidArgument(detail::cat(path_, ": corrupt gzip data (", message, ")"));
      if (got == 0 || truncated_) break;
    }
    return done;
  }

  // Whether the gzip stream was cut short (stays true once seen).
  bool truncated() const { return truncated_; }

 private:
  std::string path_;
  gzFile file_ = nullptr;
  bool truncated_ = false;
};

uint32_t big_endian(const unsigned char* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

std::string dims_text(const std::vector<int64_t>& dims) { return detail::join(dims, "x"); }

}  // namespace

void read_idx_gz(const std::string& path, const IdxSpec& spec, const IdxAllocate& allocate) {
  GzReader in(path);
  const std::string cut = " (gzip stream truncated)";

  // Header: magic, then one big-endian uint32 per dimension. The magic's
  // low byte is the number of dimensions, so checking it fixes the length.
  const size_t header_bytes = 4 * (1 + 1 + spec.item_dims.size());
  std::vector<unsigned char> buffer(header_bytes);
  unsigned char* header = buffer.data();
  size_t got = in.read(header, 4);
  DTRAIN_CHECK_ARG(got == 4, path, ": file ends inside the IDX header (", got, " bytes)",
                   in.truncated() ? cut : "");
  const uint32_t magic = big_endian(header);
  DTRAIN_CHECK_ARG(magic == spec.magic, path, ": expected magic ", spec.magic, " (IDX ",
                   spec.item_name, "), found ", magic);
  got = in.read(header + 4, header_bytes - 4);
  DTRAIN_CHECK_ARG(got == header_bytes - 4, path, ": file ends inside the IDX header (",
                   4 + got, " of ", header_bytes, " bytes)", in.truncated() ? cut : "");

  const int64_t count = big_endian(header + 4);
  std::vector<int64_t> item_dims;
  for (size_t d = 0; d < spec.item_dims.size(); ++d)
    item_dims.push_back(big_endian(header + 8 + 4 * d));
  DTRAIN_CHECK_ARG(item_dims == spec.item_dims, path, ": expected ", spec.item_name, " of ",
                   dims_text(spec.item_dims), ", found ", dims_text(item_dims));
  DTRAIN_CHECK_ARG(count == spec.count, path, ": expected ", spec.count, " ", spec.item_name,
                   ", the header says ", count);

  std::vector<int64_t> shape{count};
  shape.insert(shape.end(), item_dims.begin(), item_dims.end());
  size_t item_bytes = 1;  // the spec's, so no overflow
  for (int64_t d : item_dims) item_bytes *= static_cast<size_t>(d);
  const size_t want = item_bytes * static_cast<size_t>(count);
  uint8_t* data = allocate(shape);
  got = in.read(data, want);
  DTRAIN_CHECK_ARG(got == want, path, ": file ends after ", got / std::max<size_t>(item_bytes, 1),
                   " of ", count, " ", spec.item_name, in.truncated() ? cut : "");
  // Reading one byte more also makes zlib verify the gzip trailer (CRC and
  // length), which catches corruption inside the data.
  unsigned char extra;
  DTRAIN_CHECK_ARG(in.read(&extra, 1) == 0, path, ": unexpected data after the ", count, " ",
                   spec.item_name);
  DTRAIN_CHECK_ARG(!in.truncated(), path, ": gzip stream truncated after the ", count, " ",
                   spec.item_name, " (the gzip trailer is missing)");
}

}  // namespace dtrain::data
