#include "dumps.h"

#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <limits>
#include <type_traits>
#include <memory>
#include <nlohmann/json.hpp>
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

std::map<int, Dump> load_dumps(const std::string& dir) {
  std::unique_ptr<DIR, int (*)(DIR*)> d(opendir(dir.c_str()), closedir);
  if (!d) throw BadDump(dir + ": cannot open the directory");
  std::map<int, Dump> dumps;
  while (dirent* ent = readdir(d.get())) {
    const std::string name = ent->d_name;
    if (name.rfind("rank-", 0) != 0 || name.size() < 10 ||
        name.compare(name.size() - 5, 5, ".json") != 0)
      continue;
    const std::string path = dir + "/" + name;
    struct stat st {};
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (st.st_size > kMaxDumpBytes)
      throw BadDump(path + ": " + std::to_string(st.st_size) + " bytes, more than a dump can be");
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in) throw BadDump(path + ": cannot read it");
    Dump dump = parse_dump(text.str(), path);
    if (dumps.count(dump.rank))
      throw BadDump(path + ": rank " + std::to_string(dump.rank) + " also dumped to " +
                    dumps[dump.rank].path);
    dumps[dump.rank] = std::move(dump);
  }
  return dumps;
}

}  // namespace dtrain::trace
