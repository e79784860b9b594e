// The tensor file format's reader on files built byte by byte: a good file
// round-trips, and each kind of damage or hostility (wrong magic or
// version, a cut or padded file, a corrupt header, counts and sizes that
// claim more than the file holds, bad names, dtypes, shapes and offsets)
// is refused with a message naming the problem, before any allocation
// larger than the file.

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "checkpoint/formats/tensor_file_format.h"
#include "dtrain/errors.h"
#include "harness/assertions.h"

namespace dtrain::tensor_file {
namespace {

using testing::Contains;
using testing::what_thrown;

Entry entry(const std::string& name, DType type, std::vector<int64_t> shape) {
  Entry e;
  e.name = name;
  e.dtype = type;
  e.shape = std::move(shape);
  e.bytes = tensor_bytes(name, type, e.shape);
  return e;
}

// A file of two tensors (6 floats, 3 int64) and one metadata pair.
struct Built {
  Header header;
  std::string data;
  std::string bytes() const { return encode_prefix(header, data.size()) + data; }
};

Built good() {
  Built b;
  b.header.metadata = {{"format", "test/1"}};
  b.header.tensors = {entry("w", DType::Float32, {2, 3}), entry("n", DType::Int64, {3})};
  for (size_t i = 0; i < 6 * 4 + 3 * 8; ++i) b.data.push_back(static_cast<char>(i * 7));
  assign_offsets(b.header);
  b.header.tensors[0].crc = crc32(b.data.data(), 24);
  b.header.tensors[1].crc = crc32(b.data.data() + 24, 24);
  return b;
}

Layout parse(const std::string& file) {
  return read_layout("f", file.size(), [&](uint64_t offset, size_t n, void* out) {
    ASSERT_LE(offset + n, file.size()) << "read outside the file";
    std::memcpy(out, file.data() + offset, n);
  });
}

std::string refused(const std::string& file) {
  return what_thrown<InvalidArgument>([&] { parse(file); });
}

// Recomputes the header's CRC after bytes inside it were changed.
void reseal(std::string& file) {
  uint32_t header_bytes;
  std::memcpy(&header_bytes, file.data() + 12, 4);
  const size_t end = kPreambleBytes + header_bytes;
  const uint32_t crc = crc32(file.data(), end);
  std::memcpy(&file[end], &crc, 4);
}

TEST(TensorFileFormat, RoundTripsHeaderAndChecksums) {
  const Built b = good();
  const std::string file = b.bytes();
  const Layout l = parse(file);
  EXPECT_EQ(l.data_start % kDataAlignment, 0u);
  EXPECT_EQ(l.data_bytes, 48u);
  EXPECT_EQ(l.data_start + l.data_bytes, file.size());
  ASSERT_EQ(l.header.tensors.size(), 2u);
  EXPECT_EQ(l.header.metadata, b.header.metadata);
  const Entry& n = l.header.tensors[1];
  EXPECT_EQ(n.name, "n");
  EXPECT_EQ(n.dtype, DType::Int64);
  EXPECT_EQ(n.shape, std::vector<int64_t>{3});
  EXPECT_EQ(n.offset, 24u);
  verify("f", n, file.data() + l.data_start + n.offset);
  EXPECT_EQ(encode_prefix(l.header, l.data_bytes), file.substr(0, l.data_start));
}

TEST(TensorFileFormat, WrongMagicVersionAndShortFilesAreNamed) {
  std::string file = good().bytes();
  EXPECT_TRUE(Contains(refused(file.substr(0, 20)), "f: 20 bytes, too short for a tensor file"));
  std::string other = file;
  other[0] = 'P';
  EXPECT_TRUE(Contains(refused(other), "f: not a dtrain tensor file"));
  std::string version = file;
  version[8] = 2;
  EXPECT_TRUE(Contains(refused(version), "f: tensor file version 2; this dtrain reads version 1"));
}

TEST(TensorFileFormat, CutAndPaddedFilesAreRefused) {
  const std::string file = good().bytes();
  EXPECT_TRUE(Contains(refused(file.substr(0, file.size() - 1)),
                       "f: truncated: " + std::to_string(file.size() - 1) +
                           " bytes; its header describes " + std::to_string(file.size())));
  EXPECT_TRUE(Contains(refused(file.substr(0, 40)), "f: truncated: 40 bytes, the header alone needs"));
  EXPECT_TRUE(Contains(refused(file + "x"), "f: has " + std::to_string(file.size() + 1) +
                                                " bytes; its header describes " +
                                                std::to_string(file.size())));
}

TEST(TensorFileFormat, DamagedHeaderOrDataFailsItsChecksum) {
  std::string file = good().bytes();
  file[30] ^= 1;
  EXPECT_TRUE(Contains(refused(file), "f: the header is corrupt (checksum mismatch)"));
  file[30] ^= 1;
  const Layout l = parse(file);
  file[l.data_start + 5] ^= 1;
  const Entry& w = l.header.tensors[0];
  EXPECT_TRUE(Contains(what_thrown<InvalidArgument>([&] {
                         verify("f", w, file.data() + l.data_start);
                       }),
                       "f: tensor w is corrupt (checksum mismatch)"));
}

TEST(TensorFileFormat, HeaderSizeBeyondTheCapOrTheFileIsRefusedBeforeReading) {
  std::string file = good().bytes();
  const uint32_t huge = kMaxHeaderBytes + 1;
  std::memcpy(&file[12], &huge, 4);
  EXPECT_TRUE(Contains(refused(file), "f: a header of 67108865 bytes (at most 67108864)"));
  const uint32_t past = 1000;
  std::memcpy(&file[12], &past, 4);
  EXPECT_TRUE(Contains(refused(file), "the header alone needs 1028"));
}

TEST(TensorFileFormat, CountsClaimingMoreThanTheHeaderHoldsAreRefused) {
  std::string file = good().bytes();
  const uint32_t many = 0xffffffffu;
  std::memcpy(&file[kPreambleBytes], &many, 4);  // the metadata count
  reseal(file);
  EXPECT_TRUE(Contains(refused(file), "f: header claims 4294967295 metadata entries, more than"));
}

TEST(TensorFileFormat, BadEntriesAreNamed) {
  struct Case {
    std::function<void(Built&)> damage;
    std::string message;
  };
  const Case cases[] = {
      {[](Built& b) { b.header.tensors[1].name = "w"; }, "f: tensor w appears twice"},
      {[](Built& b) { b.header.tensors[1].name = ""; }, "f: a tensor has an empty name"},
      {[](Built& b) { b.header.tensors[1].dtype = static_cast<DType>(99); },
       "f: tensor n has the unknown dtype code 99"},
      {[](Built& b) { b.header.tensors[1].shape = {-3}; },
       "f: tensor n has the negative dimension -3 in [-3]"},
      {[](Built& b) { b.header.tensors[1].shape = {1ll << 40, 1ll << 40}; },
       "f: tensor n has the shape [1099511627776, 1099511627776], too large to exist"},
      {[](Built& b) { b.header.tensors[1].shape = {4}; },
       "f: tensor n (int64 [4]) claims 24 bytes; its shape needs 32"},
      {[](Built& b) { b.header.tensors[1].offset = 16; },
       "f: tensor n starts at 16 in the data; the tensors before it end at 24"},
      {[](Built& b) { b.data += std::string(8, '\0'); },
       "f: the tensors hold 48 bytes; the data is 56"},
      {[](Built& b) { b.header.metadata.push_back({"format", "again"}); },
       "f: metadata key format appears twice"},
      {[](Built& b) { b.header.tensors[0].shape.assign(65, 1); },
       "f: tensor w has 65 dimensions (at most 64)"},
  };
  for (const auto& c : cases) {
    Built b = good();
    c.damage(b);
    EXPECT_TRUE(Contains(refused(b.bytes()), c.message)) << c.message;
  }
}

TEST(TensorFileFormat, NonzeroPaddingIsRefused) {
  std::string file = good().bytes();
  const Layout l = parse(file);
  file[l.data_start - 1] = 1;
  EXPECT_TRUE(Contains(refused(file), "f: nonzero padding before the data"));
}

TEST(TensorFileFormat, WriterRefusesDuplicateAndEmptyNames) {
  Header h;
  h.tensors = {entry("a", DType::UInt8, {1}), entry("a", DType::UInt8, {1})};
  EXPECT_TRUE(Contains(what_thrown<InvalidArgument>([&] { assign_offsets(h); }),
                       "tensor file: tensor a appears twice"));
  h.tensors = {entry("", DType::UInt8, {1})};
  EXPECT_TRUE(Contains(what_thrown<InvalidArgument>([&] { assign_offsets(h); }),
                       "tensor file: a tensor has an empty name"));
}

}  // namespace
}  // namespace dtrain::tensor_file
