#pragma once

// Workers' error files (torchrun's TORCHELASTIC_ERROR_FILE): where
// dtrain-run puts them, and reading one back. A worker writes its own
// file, so its content is hostile: its size is capped, it is parsed as
// JSON without trusting its shape, and what is shown is bounded.

#include <cstdint>
#include <optional>
#include <string>

#include "options.h"

namespace dtrain::run {

// mkdir -p; what cannot be made shows up when a file in it is opened.
void make_dirs(const std::string& path);

struct ErrorReport {
  std::string message;  // the worker's own words (at most 30 lines / 8 KiB); may be empty
  int64_t time_ns = 0;  // when it was written, from the file (0: unknown)
  std::string problem;  // why the file could not be used; "" when it could
};

// What the error file at `path` says; nullopt when there is none. Reads
// torchrun's layout, {"message": {"message": TEXT, "extraInfo":
// {"timestamp": SECONDS}}}, and its short form {"message": TEXT}.
std::optional<ErrorReport> read_error_file(const std::string& path);

// Where this launcher's workers write their error files:
// LOG_DIR/RDZV_ID/attempt_N/LOCAL_RANK/error.json with --log-dir (beside
// the logs, as torchrun), else the same layout under a private temporary
// directory (in $TMPDIR, default /tmp), removed with this object.
class ErrorFiles {
 public:
  explicit ErrorFiles(const Options& options);
  ~ErrorFiles();
  ErrorFiles(const ErrorFiles&) = delete;
  ErrorFiles& operator=(const ErrorFiles&) = delete;

  // The file of one worker of one attempt, its directory made and a stale
  // file of an earlier run removed. "" when no directory could be made.
  std::string prepare(int attempt, int local_rank) const;

 private:
  std::string base_;
  bool temporary_ = false;
};

}  // namespace dtrain::run
