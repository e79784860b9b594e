#include "dumps.h"

#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <limits>
#include <type_traits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

namespace dtrain::trace {
namespace {

using nlohmann::json;

constexpr off_t kMaxDumpBytes = 256L << 20;  // 2000 entries x groups: far below
constexpr int kMaxRanks = 1 << 20;           // bounds every per-rank loop and list

// An integer of type T, checked: a JSON float or an out-of-range number
// would be converted with undefined behaviour by json::get<T>().
template <typename T>
T as_int(const json& v, const char* key) {
  static_assert(std::is_integral_v<T>);
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<T>::max())) return static_cast<T>(u);
  } else if (v.is_number_integer()) {
    const auto i = v.get<int64_t>();
    if (i >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
        (i < 0 || static_cast<uint64_t>(i) <= static_cast<uint64_t>(std::numeric_limits<T>::max())))
      return static_cast<T>(i);
  } else {
    throw BadDump(std::string("'") + key + "' is not an integer");
  }
  throw BadDump(std::string("'") + key + "' is out of range");
}

template <typename T>
T field(const json& j, const char* key) {
  if constexpr (std::is_integral_v<T>) return as_int<T>(j.at(key), key);
  else return j.at(key).get<T>();
}

template <typename T>
std::vector<T> int_list(const json& j, const char* key) {
  const json& list = j.at(key);
  if (!list.is_array()) throw BadDump(std::string("'") + key + "' is not a list");
  std::vector<T> out;
  for (const auto& v : list) out.push_back(as_int<T>(v, key));
  return out;
}

Entry parse_entry(const json& j) {
  Entry e;
  e.seq = field<uint64_t>(j, "seq");
  e.op = field<std::string>(j, "op");
  e.kind = field<std::string>(j, "kind");
  e.dtype = field<std::string>(j, "dtype");
  e.shape = int_list<int64_t>(j, "shape");
  e.root = field<int64_t>(j, "root");
  e.reduce_op = field<std::string>(j, "reduce_op");
  e.state = field<std::string>(j, "state");
  e.issued_us = field<int64_t>(j, "issued_us");
  e.finished_us = field<int64_t>(j, "finished_us");
  e.error = field<std::string>(j, "error");
  if (j.contains("label")) e.label = field<std::string>(j, "label");
  if (e.kind != "collective" && e.kind != "p2p") throw BadDump("unknown kind '" + e.kind + "'");
  return e;
}

Group parse_group(const json& j) {
  Group g;
  g.name = field<std::string>(j, "name");
  g.backend = field<std::string>(j, "backend");
  g.rank = field<int>(j, "rank");
  g.size = field<int>(j, "size");
  g.global_ranks = int_list<int>(j, "global_ranks");
  if (g.size <= 0 || g.size > kMaxRanks || static_cast<int>(g.global_ranks.size()) != g.size ||
      g.rank < 0 || g.rank >= g.size)
    throw BadDump("group '" + g.name + "' has inconsistent rank, size and global_ranks");
  for (int r : g.global_ranks)
    if (r < 0 || r >= kMaxRanks) throw BadDump("group '" + g.name + "' names global rank " + std::to_string(r));
  for (const auto& e : j.at("entries")) g.entries.push_back(parse_entry(e));
  return g;
}

}  // namespace

std::string Entry::signature() const {
  std::ostringstream out;
  out << op;
  if (!dtype.empty()) {
    out << " (" << dtype << " [";
    for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
    out << "]";
    if (!reduce_op.empty()) out << ", " << reduce_op;
    if (root >= 0) out << ", root " << root;
    out << ")";
  }
  return out.str();
}

Dump parse_dump(const std::string& text, const std::string& path) {
  try {
    const json j = json::parse(text);
    if (!j.is_object() || j.value("format", "") != "dtrain-flight-recorder")
      throw BadDump("not a dtrain flight recorder dump");
    if (field<int>(j, "version") != 1)
      throw BadDump("version " + std::to_string(field<int>(j, "version")) + " is not supported");
    Dump d;
    d.path = path;
    d.rank = field<int>(j, "rank");
    d.world_size = field<int>(j, "world_size");
    d.pid = field<long>(j, "pid");
    d.host = field<std::string>(j, "host");
    d.reason = field<std::string>(j, "reason");
    if (d.world_size != -1 && (d.world_size < 1 || d.world_size > kMaxRanks))
      throw BadDump("world_size " + std::to_string(d.world_size) + " is out of range");
    if (d.rank < 0 || d.rank >= (d.world_size > 0 ? d.world_size : kMaxRanks))
      throw BadDump("rank " + std::to_string(d.rank) + " is out of range");
    for (const auto& g : j.at("groups")) d.groups.push_back(parse_group(g));
    return d;
  } catch (const BadDump& e) {
    throw BadDump(path + ": " + e.what());
  } catch (const json::exception& e) {
    throw BadDump(path + ": not a valid dump: " + e.what());
  }
}

namespace {

constexpr off_t kMaxErrorBytes = 1 << 20;  // dtrain-run writes at most 8 KiB of message
constexpr size_t kMaxSalvageTries = 8;

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The names in `dir` that start with `head` and end with `tail`, with
// something between.
std::vector<std::string> names_in(const std::string& dir, const std::string& head,
                                  const std::string& tail) {
  std::unique_ptr<DIR, int (*)(DIR*)> d(opendir(dir.c_str()), closedir);
  if (!d) throw BadDump(dir + ": cannot open the directory");
  std::vector<std::string> out;
  while (dirent* ent = readdir(d.get())) {
    const std::string name = ent->d_name;
    if (name.size() > head.size() + tail.size() && name.rfind(head, 0) == 0 && ends_with(name, tail))
      out.push_back(name);
  }
  return out;
}

// The text of a regular file of at most `max` bytes; nullopt when `path`
// is not a regular file.
std::optional<std::string> read_capped(const std::string& path, off_t max, const char* what) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  if (st.st_size > max)
    throw BadDump(path + ": " + std::to_string(st.st_size) + " bytes, more than " + what + " can be");
  std::ifstream in(path, std::ios::binary);
  std::string text(static_cast<size_t>(st.st_size), '\0');
  in.read(text.data(), st.st_size);
  if (!in) throw BadDump(path + ": cannot read it");
  return text;
}

// The places where `text` may be cut and closed into valid JSON: after an
// object ('}') or an array's opening ('['), outside strings, within the
// root object. Each comes with the brackets that close it.
std::vector<std::pair<size_t, std::string>> cut_points(const std::string& text) {
  std::vector<std::pair<size_t, std::string>> cuts;
  std::string open;  // the open brackets
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (open.size() >= 16) break;  // deeper than a dump: not one
      open += c;
    } else if (c == '}' || c == ']') {
      if (open.empty() || (c == '}') != (open.back() == '{')) break;
      open.pop_back();
    } else {
      continue;
    }
    if (open.empty() || (c != '}' && c != '[')) continue;
    std::string closers;
    for (auto it = open.rbegin(); it != open.rend(); ++it) closers += *it == '{' ? '}' : ']';
    cuts.emplace_back(i + 1, closers);
  }
  return cuts;
}

}  // namespace

Dump salvage_dump(const std::string& text, const std::string& path) {
  const auto cuts = cut_points(text);
  std::string last_problem = "nothing in it is whole";
  size_t tries = 0;
  for (auto it = cuts.rbegin(); it != cuts.rend() && tries < kMaxSalvageTries; ++it, ++tries) {
    try {
      Dump d = parse_dump(text.substr(0, it->first) + it->second, path);
      d.incomplete = true;
      return d;
    } catch (const BadDump& e) {
      last_problem = e.what();
    }
  }
  throw BadDump(path + ": an unfinished dump with nothing usable (" + last_problem + ")");
}

std::map<int, Dump> load_dumps(const std::string& dir) {
  std::map<int, Dump> dumps;
  for (const auto& name : names_in(dir, "rank-", ".json")) {
    const std::string path = dir + "/" + name;
    const auto text = read_capped(path, kMaxDumpBytes, "a dump");
    if (!text) continue;
    Dump dump = parse_dump(*text, path);
    if (dumps.count(dump.rank))
      throw BadDump(path + ": rank " + std::to_string(dump.rank) + " also dumped to " +
                    dumps[dump.rank].path);
    dumps[dump.rank] = std::move(dump);
  }
  return dumps;
}

Evidence load_evidence(const std::string& dir) {
  Evidence ev;
  ev.dumps = load_dumps(dir);
  for (const auto& name : names_in(dir, "rank-", ".json.tmp")) {
    const std::string path = dir + "/" + name;
    const auto text = read_capped(path, kMaxDumpBytes, "a dump");
    if (!text) continue;
    try {
      Dump dump = salvage_dump(*text, path);
      if (!ev.dumps.count(dump.rank)) ev.dumps[dump.rank] = std::move(dump);
    } catch (const BadDump& e) {
      ev.unusable.push_back(e.what());
    }
  }
  for (const auto& name : names_in(dir, "error-", ".json")) {
    const std::string path = dir + "/" + name;
    const auto text = read_capped(path, kMaxErrorBytes, "an error note");
    if (!text) continue;
    try {
      const json j = json::parse(*text);
      const int rank = field<int>(j, "rank");
      if (rank < 0 || rank >= kMaxRanks) throw BadDump("rank " + std::to_string(rank) + " is out of range");
      ev.errors[rank] = ErrorNote{path, field<std::string>(j, "message")};
    } catch (const BadDump& e) {
      throw BadDump(path + ": " + e.what());
    } catch (const json::exception& e) {
      throw BadDump(path + ": not a valid error note: " + e.what());
    }
  }
  return ev;
}

}  // namespace dtrain::trace
