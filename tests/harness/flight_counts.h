#pragma once

// The collectives a flight-recorder dump holds, counted by operation, for
// tests that assert how many calls a layer makes.

#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace dtrain::testing {

inline size_t occurrences(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// all_reduce, all_gather_into_tensor and reduce_scatter_tensor in the dump
// at `path` (every group's entries in it).
inline std::map<std::string, size_t> tensor_parallel_collectives(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::map<std::string, size_t> ops;
  for (const char* op : {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"})
    ops[op] = occurrences(text.str(), std::string("\"op\": \"") + op + "\"");
  return ops;
}

}  // namespace dtrain::testing
