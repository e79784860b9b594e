#pragma once

// A private directory under /tmp, removed with everything in it.

#include <string>

#include "common/paths.h"

namespace dtrain::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "dtrain-test-") : path_(paths::make_temp_dir(prefix)) {}
  ~TempDir() { paths::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return paths::join(path_, name); }

 private:
  std::string path_;
};

}  // namespace dtrain::testing
