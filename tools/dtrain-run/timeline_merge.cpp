#include "timeline_merge.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace dtrain::run {

std::vector<int> merge_timeline(const std::string& path, const std::vector<int>& ranks) {
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + tmp);
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  std::vector<int> merged;
  for (int rank : ranks) {
    const std::string part = path + ".rank-" + std::to_string(rank) + ".json";
    std::ifstream in(part);
    if (!in) continue;
    std::string line;
    while (std::getline(in, line)) {
      // Events are whole lines "{...}," ; a line cut short by a crash, or
      // anything else, is left out.
      if (line.size() < 3 || line.front() != '{' || line.compare(line.size() - 2, 2, "},") != 0)
        continue;
      out << (first ? "" : ",\n") << line.substr(0, line.size() - 1);
      first = false;
    }
    merged.push_back(rank);
  }
  out << "\n]}\n";
  out.close();
  if (!out) throw std::runtime_error("cannot write " + tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot rename " + tmp + " to " + path);
  }
  for (int rank : merged) std::remove((path + ".rank-" + std::to_string(rank) + ".json").c_str());
  return merged;
}

}  // namespace dtrain::run
