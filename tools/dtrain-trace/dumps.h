#pragma once

// Flight recorder dumps (DTRAIN_TRACE_DIR/rank-R.json, written by
// src/core/flight_recorder.cpp), read and checked: a file that is not a
// dump, or is cut short, is an error naming the file and what was wrong.

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::trace {

struct Entry {
  uint64_t seq = 0;
  std::string op, kind, dtype, reduce_op, state, error;
  std::vector<int64_t> shape;
  int64_t root = -1;
  int64_t issued_us = 0, finished_us = 0;
  bool collective() const { return kind == "collective"; }
  // "all_reduce (Float [4, 4], SUM)": what ranks must agree on.
  std::string signature() const;
};

struct Group {
  std::string name, backend;
  int rank = -1, size = 0;
  std::vector<int> global_ranks;
  std::vector<Entry> entries;  // oldest first
};

struct Dump {
  std::string path, host, reason;
  int rank = -1, world_size = -1;
  long pid = 0;
  std::vector<Group> groups;
};

struct BadDump : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Parses one dump's text (`path` names it in errors).
Dump parse_dump(const std::string& text, const std::string& path);
// Every rank-*.json in `dir`, by global rank. Throws BadDump for a file
// that cannot be read or parsed, or two files claiming one rank.
std::map<int, Dump> load_dumps(const std::string& dir);

}  // namespace dtrain::trace
