// The safetensors header (safetensors_format.h): a strict reader of the
// JSON it allows, and its writer.

#include "checkpoint/formats/safetensors_format.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>

#include "dtrain/errors.h"

namespace dtrain::safetensors {
namespace {

struct DTypeInfo {
  DType type;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::Bool, "BOOL", 1},    {DType::UInt8, "U8", 1},     {DType::Int8, "I8", 1},
    {DType::Int16, "I16", 2},    {DType::Int32, "I32", 4},    {DType::Int64, "I64", 8},
    {DType::Float16, "F16", 2},  {DType::BFloat16, "BF16", 2}, {DType::Float32, "F32", 4},
    {DType::Float64, "F64", 8},
};

[[noreturn]] void bad(const std::string& what, const std::string& problem) {
  throw InvalidArgument("safetensors " + what + ": " + problem);
}

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (const unsigned char c : s.substr(0, 200)) out += (c < 0x20 || c == 0x7f) ? '?' : static_cast<char>(c);
  return out + (s.size() > 200 ? "...'" : "'");
}

// A cursor over the header's text, for the JSON the format uses: objects,
// arrays, strings and non-negative integers.
class Cursor {
 public:
  Cursor(const std::string& what, const std::string& text) : what_(what), s_(text) {}

  [[noreturn]] void fail(const std::string& problem) const {
    bad(what_, "header byte " + std::to_string(i_) + ": " + problem);
  }
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool next_is(char c) {
    skip_space();
    return i_ < s_.size() && s_[i_] == c;
  }
  void expect(char c, const std::string& context) {
    if (!next_is(c)) fail(std::string("expected '") + c + "' " + context);
    ++i_;
  }
  // After an element of an object or array: true if another follows.
  bool more(char close, const std::string& context) {
    if (next_is(',')) {
      ++i_;
      return true;
    }
    expect(close, context);
    return false;
  }
  bool at_end() {
    skip_space();
    return i_ == s_.size();
  }

  std::string string(const std::string& context) {
    expect('"', context);
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("a string that does not end " + context);
      const unsigned char c = static_cast<unsigned char>(s_[i_++]);
      if (c == '"') return out;
      if (c < 0x20) fail("a control character inside a string " + context);
      if (c != '\\') {
        out += static_cast<char>(c);
        continue;
      }
      if (i_ >= s_.size()) fail("a string that does not end " + context);
      const char e = s_[i_++];
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': append_utf8(out, code_point(context)); break;
        default: fail(std::string("an unknown escape \\") + e + " " + context);
      }
    }
  }

  // A non-negative integer of at most 2^63 - 1.
  uint64_t integer(const std::string& context) {
    skip_space();
    if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9') fail("expected a non-negative integer " + context);
    uint64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      const uint64_t digit = static_cast<uint64_t>(s_[i_++] - '0');
      if (v > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - digit) / 10)
        fail("an integer over 2^63 - 1 " + context);
      v = v * 10 + digit;
    }
    if (i_ < s_.size() && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E'))
      fail("a number that is not an integer " + context);
    return v;
  }

 private:
  uint32_t hex4(const std::string& context) {
    if (s_.size() - i_ < 4) fail("a \\u escape cut short " + context);
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= static_cast<uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f') v |= static_cast<uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= static_cast<uint32_t>(h - 'A' + 10);
      else fail("a \\u escape with a non-hex digit " + context);
    }
    return v;
  }
  uint32_t code_point(const std::string& context) {
    const uint32_t high = hex4(context);
    if (high >= 0xDC00 && high <= 0xDFFF) fail("a lone low surrogate " + context);
    if (high < 0xD800 || high > 0xDBFF) return high;
    if (s_.size() - i_ < 2 || s_[i_] != '\\' || s_[i_ + 1] != 'u') fail("a lone high surrogate " + context);
    i_ += 2;
    const uint32_t low = hex4(context);
    if (low < 0xDC00 || low > 0xDFFF) fail("a high surrogate without its low one " + context);
    return 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00);
  }
  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  const std::string& what_;
  const std::string& s_;
  size_t i_ = 0;
};

DType dtype_named(Cursor& c, const std::string& name, const std::string& type) {
  for (const auto& d : kDTypes)
    if (type == d.name) return d.type;
  std::string known;
  for (const auto& d : kDTypes) known += std::string(known.empty() ? "" : ", ") + d.name;
  c.fail("tensor " + quoted(name) + ": dtype " + quoted(type) + " is not one dtrain reads (" + known + ")");
}

Entry tensor(Cursor& c, const std::string& name) {
  Entry e;
  e.name = name;
  const std::string of = "in tensor " + quoted(name);
  bool has_dtype = false, has_shape = false, has_offsets = false;
  c.expect('{', of);
  if (!c.next_is('}')) {
    do {
      const std::string field = c.string("as a field name " + of);
      c.expect(':', "after field " + quoted(field) + " " + of);
      if (field == "dtype" && !has_dtype) {
        e.dtype = dtype_named(c, name, c.string("as the dtype " + of));
        has_dtype = true;
      } else if (field == "shape" && !has_shape) {
        c.expect('[', "opening the shape " + of);
        if (!c.next_is(']')) {
          do {
            if (e.shape.size() == kMaxDims) c.fail("more than " + std::to_string(kMaxDims) + " dimensions " + of);
            e.shape.push_back(static_cast<int64_t>(c.integer("in the shape " + of)));
          } while (c.more(']', "closing the shape " + of));
        } else {
          c.expect(']', "closing the shape " + of);
        }
        has_shape = true;
      } else if (field == "data_offsets" && !has_offsets) {
        c.expect('[', "opening data_offsets " + of);
        e.begin = c.integer("as data_offsets' begin " + of);
        c.expect(',', "between data_offsets' begin and end " + of);
        e.end = c.integer("as data_offsets' end " + of);
        c.expect(']', "closing data_offsets (two numbers) " + of);
        has_offsets = true;
      } else {
        c.fail("field " + quoted(field) + (field == "dtype" || field == "shape" || field == "data_offsets"
                                               ? " given twice " : " is not a safetensors field ") + of);
      }
    } while (c.more('}', "closing " + quoted(name) + "'s object"));
  } else {
    c.expect('}', of);
  }
  if (!has_dtype || !has_shape || !has_offsets)
    c.fail("tensor " + quoted(name) + " lacks " + (!has_dtype ? "dtype" : !has_shape ? "shape" : "data_offsets"));
  return e;
}

void metadata(Cursor& c, Layout& out) {
  c.expect('{', "opening __metadata__");
  if (c.next_is('}')) {
    c.expect('}', "closing __metadata__");
    return;
  }
  std::set<std::string> keys;
  do {
    std::string key = c.string("as a __metadata__ key");
    c.expect(':', "after __metadata__ key " + quoted(key));
    if (!c.next_is('"')) c.fail("__metadata__ " + quoted(key) + ": its value is not a string");
    std::string value = c.string("as __metadata__ " + quoted(key) + "'s value");
    if (!keys.insert(key).second) c.fail("__metadata__ key " + quoted(key) + " given twice");
    out.metadata.emplace_back(std::move(key), std::move(value));
  } while (c.more('}', "closing __metadata__"));
}

uint64_t entry_bytes(const std::string& what, const Entry& e) {
  uint64_t n = element_size(e.dtype);
  for (const int64_t d : e.shape) {
    if (d < 0) bad(what, "tensor " + quoted(e.name) + ": a negative dimension");
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d))
      bad(what, "tensor " + quoted(e.name) + ": its shape's size overflows");
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

// Every tensor's offsets against its shape, and the tensors together
// against the data: packed from 0, no overlap, no hole, nothing past it.
void check_offsets(const std::string& what, const Layout& l) {
  std::vector<size_t> order(l.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  for (const auto& e : l.tensors) {
    const std::string t = "tensor " + quoted(e.name) + ": data_offsets [" + std::to_string(e.begin) + ", " +
                          std::to_string(e.end) + ")";
    if (e.end < e.begin) bad(what, t + " end before they begin");
    if (e.end > l.data_bytes) bad(what, t + " run past the data's " + std::to_string(l.data_bytes) + " bytes");
    const uint64_t want = entry_bytes(what, e);
    if (e.end - e.begin != want)
      bad(what, t + " hold " + std::to_string(e.end - e.begin) + " bytes, but its dtype and shape need " +
                    std::to_string(want));
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto& x = l.tensors[a];
    const auto& y = l.tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t covered = 0;
  const Entry* last = nullptr;
  for (const size_t i : order) {
    const auto& e = l.tensors[i];
    if (e.begin < covered)
      bad(what, "tensor " + quoted(e.name) + "'s bytes [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                    ") overlap tensor " + quoted(last->name) + "'s");
    if (e.begin > covered)
      bad(what, "bytes [" + std::to_string(covered) + ", " + std::to_string(e.begin) + ") of the data belong to no tensor");
    covered = e.end;
    if (e.end > e.begin) last = &e;
  }
  if (covered != l.data_bytes)
    bad(what, "bytes [" + std::to_string(covered) + ", " + std::to_string(l.data_bytes) +
                  ") of the data belong to no tensor");
}

void append_json_string(std::string& out, const std::string& s) {  // json_string's body
  out += '"';
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      static const char* hex = "0123456789abcdef";
      out += "\\u00";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

}  // namespace

std::string json_string(const std::string& s) {
  std::string out;
  append_json_string(out, s);
  return out;
}

const char* dtype_name(DType type) {
  for (const auto& d : kDTypes)
    if (d.type == type) return d.name;
  return "?";
}

size_t element_size(DType type) {
  for (const auto& d : kDTypes)
    if (d.type == type) return d.size;
  return 0;
}

Layout read_layout(const std::string& what, uint64_t file_size, const ReadAt& read) {
  if (file_size < 8)
    bad(what, "the file is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  unsigned char length[8];
  read(0, 8, length);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | length[k];
  if (n > kMaxHeaderBytes)
    bad(what, "header length " + std::to_string(n) + " is over the format's limit of " +
                  std::to_string(kMaxHeaderBytes) + " bytes");
  if (n > file_size - 8)
    bad(what, "header length " + std::to_string(n) + " runs past the end of the file (" +
                  std::to_string(file_size) + " bytes)");
  std::string text(static_cast<size_t>(n), '\0');
  if (n > 0) read(8, static_cast<size_t>(n), text.data());
  Layout out;
  out.data_start = 8 + n;
  out.data_bytes = file_size - 8 - n;
  Cursor c(what, text);
  c.expect('{', "opening the header");
  std::set<std::string> names;
  bool has_metadata = false;
  if (!c.next_is('}')) {
    do {
      std::string name = c.string("as a tensor name");
      c.expect(':', "after " + quoted(name));
      if (name == "__metadata__") {
        if (has_metadata) c.fail("__metadata__ given twice");
        has_metadata = true;
        metadata(c, out);
        continue;
      }
      if (name.empty()) c.fail("a tensor with an empty name");
      if (!names.insert(name).second) c.fail("tensor " + quoted(name) + " given twice");
      if (out.tensors.size() == kMaxTensors) c.fail("more than " + std::to_string(kMaxTensors) + " tensors");
      out.tensors.push_back(tensor(c, name));
    } while (c.more('}', "closing the header"));
  } else {
    c.expect('}', "closing the header");
  }
  if (!c.at_end()) c.fail("text after the header's object");
  check_offsets(what, out);
  return out;
}

std::string encode_prefix(std::vector<Entry>& tensors,
                          const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::set<std::string> names;
  uint64_t offset = 0;
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i) json += ',';
      append_json_string(json, metadata[i].first);
      json += ':';
      append_json_string(json, metadata[i].second);
    }
    json += '}';
  }
  for (auto& e : tensors) {
    if (e.name.empty() || e.name == "__metadata__" || !names.insert(e.name).second)
      throw InvalidArgument("safetensors: tensor name " + quoted(e.name) +
                            " is empty, reserved or given twice");
    if (e.shape.size() > kMaxDims) throw InvalidArgument("safetensors: tensor " + quoted(e.name) + " has too many dimensions");
    e.begin = offset;
    e.end = offset += entry_bytes("writing", e);
    if (json.size() > 1) json += ',';
    append_json_string(json, e.name);
    json += ":{\"dtype\":\"" + std::string(dtype_name(e.dtype)) + "\",\"shape\":[";
    for (size_t d = 0; d < e.shape.size(); ++d) json += (d ? "," : "") + std::to_string(e.shape[d]);
    json += "],\"data_offsets\":[" + std::to_string(e.begin) + "," + std::to_string(e.end) + "]}";
  }
  json += '}';
  json.append((8 - json.size() % 8) % 8, ' ');  // the data starts at a multiple of 8
  if (json.size() > kMaxHeaderBytes) throw InvalidArgument("safetensors: the header would exceed the format's limit");
  std::string prefix(8, '\0');
  uint64_t n = json.size();
  for (int k = 0; k < 8; ++k, n >>= 8) prefix[static_cast<size_t>(k)] = static_cast<char>(n & 0xFF);
  return prefix + json;
}

}  // namespace dtrain::safetensors
