#pragma once

// Flight recorder dumps (DTRAIN_TRACE_DIR/rank-R.json, written by
// src/diagnostics/flight_recorder.cpp), read and checked: a file that is not a
// dump, or is cut short, is an error naming the file and what was wrong.
// Two kinds of partial evidence are used too: rank-R.json.tmp, a dump its
// process did not finish (what it holds whole is read), and error-R.json,
// what a failed worker's error file said (copied there by dtrain-run).

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::trace {

struct Entry {
  uint64_t seq = 0;
  std::string op, kind, dtype, reduce_op, state, error;
  std::string label;  // what issued it (a batch, a pipeline stage); may be empty
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
  bool incomplete = false;  // salvaged from a rank-R.json.tmp cut short
  std::vector<Group> groups;
};

// What a failed rank's error file said (error-R.json).
struct ErrorNote {
  std::string path, message;
};

// Everything in a trace directory.
struct Evidence {
  std::map<int, Dump> dumps;          // by global rank
  std::map<int, ErrorNote> errors;    // by global rank
  std::vector<std::string> unusable;  // .tmp files with nothing whole in them
};

struct BadDump : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Parses one dump's text (`path` names it in errors).
Dump parse_dump(const std::string& text, const std::string& path);
// The part of a dump cut short that was written whole: its header and
// every entry up to the cut, as an incomplete Dump. Throws BadDump when
// not even the header is whole.
Dump salvage_dump(const std::string& text, const std::string& path);
// Every rank-*.json in `dir`, by global rank. Throws BadDump for a file
// that cannot be read or parsed, or two files claiming one rank.
std::map<int, Dump> load_dumps(const std::string& dir);
// load_dumps, plus the rank-*.json.tmp of ranks without a complete dump
// and the error-*.json files. Throws BadDump as load_dumps does, and for
// an error-*.json that is not one.
Evidence load_evidence(const std::string& dir);

}  // namespace dtrain::trace
