// The safetensors header reader on files written by hand from the
// published format: a good file (escapes, metadata, every dtype, an empty
// and a scalar tensor) reads as written and round-trips through the
// writer; each kind of hostility (a short file, a header length over the
// limit or past the end, JSON that is not the format's shape, an unknown
// dtype, a shape whose size overflows, offsets that disagree with the shape,
// overlap, leave a hole or run past the data) is refused naming the tensor
// and the field.

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "checkpoint/formats/safetensors_format.h"
#include "dtrain/errors.h"
#include "harness/assertions.h"

namespace dtrain::safetensors {
namespace {

using testing::what_thrown;

// A file: the 8-byte length of `header`, `header`, then `data`.
std::string file_of(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int k = 0; k < 8; ++k, n >>= 8) out[static_cast<size_t>(k)] = static_cast<char>(n & 0xFF);
  return out + header + data;
}

Layout parse(const std::string& file) {
  return read_layout("f", file.size(), [&](uint64_t offset, size_t n, void* out) {
    ASSERT_LE(offset + n, file.size());
    std::memcpy(out, file.data() + offset, n);
  });
}

std::string refusal(const std::string& file) {
  return what_thrown<InvalidArgument>([&] { parse(file); });
}

TEST(SafetensorsFormat, AFileWrittenByHandReadsAsWritten) {
  const std::string header =
      R"( {"__metadata__": {"format": "pt", "note": "a\nb"},
          "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
          "layers.0.\u00e9\"q\\": {"data_offsets": [24, 28], "shape": [2], "dtype": "BF16"},
          "s": {"dtype": "I64", "shape": [], "data_offsets": [28, 36]},
          "e": {"dtype": "BOOL", "shape": [0, 5], "data_offsets": [36, 36]}}   )";
  const auto l = parse(file_of(header, std::string(36, 'x')));
  ASSERT_EQ(l.tensors.size(), 4u);
  EXPECT_EQ(l.tensors[1].name, "layers.0.\xc3\xa9\"q\\");
  EXPECT_EQ(l.tensors[1].dtype, DType::BFloat16);
  EXPECT_EQ(l.tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(l.tensors[2].shape.empty());
  EXPECT_EQ(l.tensors[3].begin, 36u);
  EXPECT_EQ(l.metadata, (std::vector<std::pair<std::string, std::string>>{{"format", "pt"}, {"note", "a\nb"}}));
  EXPECT_EQ(l.data_start, 8 + header.size());
  EXPECT_EQ(l.data_bytes, 36u);
  // Written again: the data starts at a multiple of 8, and it reads alike.
  auto tensors = l.tensors;
  const std::string prefix = encode_prefix(tensors, l.metadata);
  EXPECT_EQ(prefix.size() % 8, 0u);
  const auto again = parse(prefix + std::string(36, 'x'));
  ASSERT_EQ(again.tensors.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(again.tensors[i].name, l.tensors[i].name);
    EXPECT_EQ(again.tensors[i].shape, l.tensors[i].shape);
    EXPECT_EQ(again.tensors[i].begin, tensors[i].begin);
  }
  EXPECT_EQ(again.metadata, l.metadata);
  EXPECT_EQ(parse(file_of("{}")).tensors.size(), 0u);
}

TEST(SafetensorsFormat, LengthsThatTheFileCannotHoldAreRefusedBeforeReading) {
  EXPECT_EQ(refusal("abc"), "safetensors f: the file is 3 bytes, shorter than the 8-byte header length");
  std::string huge(8, '\0');
  huge[4] = 1;  // 2^32
  EXPECT_EQ(refusal(huge), "safetensors f: header length 4294967296 is over the format's limit of "
                           "100000000 bytes");
  std::string past = file_of("{}");
  past[0] = 40;
  EXPECT_EQ(refusal(past), "safetensors f: header length 40 runs past the end of the file (10 bytes)");
}

TEST(SafetensorsFormat, HeadersThatAreNotTheFormatsJsonAreNamed) {
  const std::string w = R"("w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})";
  auto header = [&](const std::string& inner) { return refusal(file_of("{" + inner + "}", "abcd")); };
  EXPECT_EQ(refusal(file_of("[]")), "safetensors f: header byte 0: expected '{' opening the header");
  EXPECT_EQ(refusal(file_of("{" + w + "} x", "abcd")), "safetensors f: header byte 62: text after the header's object");
  EXPECT_EQ(header(R"("w": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]})"),
            "safetensors f: header byte 25: tensor 'w': dtype 'F8_E4M3' is not one dtrain reads "
            "(BOOL, U8, I8, I16, I32, I64, F16, BF16, F32, F64)");
  EXPECT_EQ(header(R"("w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]})"),
            "safetensors f: header byte 33: expected a non-negative integer in the shape in tensor 'w'");
  EXPECT_EQ(header(R"("w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]})"),
            "safetensors f: header byte 34: a number that is not an integer in the shape in tensor 'w'");
  EXPECT_EQ(header(R"("w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1})"),
            "safetensors f: header byte 65: field 'x' is not a safetensors field in tensor 'w'");
  EXPECT_EQ(header(R"("w": {"dtype": "F32", "shape": [1]})"), "safetensors f: header byte 36: tensor 'w' lacks data_offsets");
  EXPECT_EQ(header(w + "," + w), "safetensors f: header byte 65: tensor 'w' given twice");
  EXPECT_EQ(header(R"("__metadata__": {"k": 1}, )" + w),
            "safetensors f: header byte 23: __metadata__ 'k': its value is not a string");
  EXPECT_EQ(header(R"("w\ud800": 1)"), "safetensors f: header byte 9: a lone high surrogate as a tensor name");
  EXPECT_EQ(header(R"("w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 99999999999999999999]})"),
            "safetensors f: header byte 76: an integer over 2^63 - 1 as data_offsets' end in tensor 'w'");
}

TEST(SafetensorsFormat, OffsetsMustTileTheDataExactly) {
  auto with = [](const std::string& tensors, size_t data) {
    return refusal(file_of("{" + tensors + "}", std::string(data, 'x')));
  };
  auto t = [](const std::string& name, const std::string& shape, uint64_t b, uint64_t e) {
    return "\"" + name + "\": {\"dtype\": \"F32\", \"shape\": " + shape + ", \"data_offsets\": [" +
           std::to_string(b) + ", " + std::to_string(e) + "]}";
  };
  EXPECT_EQ(with(t("a", "[2]", 0, 4), 4), "safetensors f: tensor 'a': data_offsets [0, 4) hold 4 bytes, but its "
                                           "dtype and shape need 8");
  EXPECT_EQ(with(t("a", "[1]", 4, 0), 4), "safetensors f: tensor 'a': data_offsets [4, 0) end before they begin");
  EXPECT_EQ(with(t("a", "[1]", 0, 4), 2), "safetensors f: tensor 'a': data_offsets [0, 4) run past the data's 2 bytes");
  EXPECT_EQ(with(t("a", "[2]", 0, 8) + "," + t("b", "[1]", 4, 8), 8),
            "safetensors f: tensor 'b''s bytes [4, 8) overlap tensor 'a''s");
  EXPECT_EQ(with(t("a", "[1]", 0, 4) + "," + t("b", "[1]", 8, 12), 12),
            "safetensors f: bytes [4, 8) of the data belong to no tensor");
  EXPECT_EQ(with(t("a", "[1]", 0, 4), 6), "safetensors f: bytes [4, 6) of the data belong to no tensor");
  EXPECT_EQ(with(t("a", "[4611686018427387904, 8]", 0, 4), 4), "safetensors f: tensor 'a': its shape's size overflows");
}

TEST(SafetensorsFormat, TheWriterRefusesNamesItCannotWrite) {
  std::vector<Entry> twice{{"a", DType::Float32, {1}, 0, 0}, {"a", DType::Float32, {1}, 0, 0}};
  EXPECT_EQ(what_thrown<InvalidArgument>([&] { encode_prefix(twice, {}); }),
            "safetensors: tensor name 'a' is empty, reserved or given twice");
  std::vector<Entry> reserved{{"__metadata__", DType::Float32, {1}, 0, 0}};
  EXPECT_THROW(encode_prefix(reserved, {}), InvalidArgument);
}

}  // namespace
}  // namespace dtrain::safetensors
