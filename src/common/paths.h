#pragma once

// File-system helpers on POSIX calls. dtrain does not use std::filesystem:
// PyTorch's own libtorch builds export a statically linked copy of it, and a
// reference from our binaries would bind to theirs (see docs/compatibility.md).

#include <string>
#include <vector>

namespace dtrain::paths {

bool exists(const std::string& path);
bool is_directory(const std::string& path);
// "a/b" from "a" and "b" (one separator).
std::string join(const std::string& dir, const std::string& name);
// Names in a directory, without "." and ".."; empty when it cannot be read.
std::vector<std::string> list(const std::string& dir);
// A new private directory under /tmp, named prefix + random characters.
std::string make_temp_dir(const std::string& prefix);
// Removes a file or a directory tree; missing paths are fine.
void remove_all(const std::string& path);
// Copies a regular file (overwriting); throws InvalidArgument on failure.
void copy_file(const std::string& from, const std::string& to);

}  // namespace dtrain::paths
