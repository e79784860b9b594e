#include "error_file.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

namespace dtrain::run {
namespace {

constexpr size_t kMaxFileBytes = 1 << 20;
constexpr size_t kMaxShownBytes = 8 << 10;
constexpr int kMaxShownLines = 30;

// Seconds or nanoseconds as torchrun (a string) or others (a number) write
// them, in ns; 0 for what is not a time since 1970 that fits.
int64_t number(const nlohmann::json& j, int64_t scale) {
  double value = 0;
  try {
    if (j.is_number()) value = j.get<double>();
    else if (j.is_string()) value = std::stod(j.get<std::string>());
  } catch (const std::exception&) {
    return 0;
  }
  const double ns = value * static_cast<double>(scale);
  if (!(ns > 0) || ns >= 9.0e18) return 0;  // also NaN
  if (j.is_number_integer() && scale == 1) return j.get<int64_t>();
  if (j.is_string() && scale == 1 && j.get<std::string>().find_first_not_of("0123456789") == std::string::npos)
    return std::stoll(j.get<std::string>());  // exact, not through a double
  return static_cast<int64_t>(ns);
}

// The first lines of `text`, within the caps.
std::string bounded(const std::string& text) {
  std::string out;
  int lines = 0;
  for (char c : text) {
    if (out.size() >= kMaxShownBytes) return out + "\n[... cut]";
    if (c == '\n' && ++lines >= kMaxShownLines) return out + "\n[... cut]";
    out += c;
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

ErrorReport parse(const std::string& text) {
  ErrorReport r;
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    r.problem = "it is not JSON";
    return r;
  }
  if (!j.is_object() || !j.contains("message")) {
    r.problem = "it has no \"message\" (not torchrun's error file format)";
    return r;
  }
  const auto& m = j["message"];
  if (m.is_string()) {
    r.message = bounded(m.get<std::string>());
    return r;
  }
  if (!m.is_object() || !m.contains("message") || !m["message"].is_string()) {
    r.problem = "its \"message\" is neither a text nor an object with a text \"message\"";
    return r;
  }
  r.message = bounded(m["message"].get<std::string>());
  if (m.contains("extraInfo") && m["extraInfo"].is_object()) {
    const auto& extra = m["extraInfo"];
    if (extra.contains("dtrain_timestamp_ns")) r.time_ns = number(extra["dtrain_timestamp_ns"], 1);
    if (r.time_ns == 0 && extra.contains("timestamp")) r.time_ns = number(extra["timestamp"], 1000000000);
  }
  return r;
}

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  ::remove(path);
  return 0;
}

}  // namespace

void make_dirs(const std::string& path) {
  std::string partial;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!partial.empty()) ::mkdir(partial.c_str(), 0755);
    }
    if (i < path.size()) partial += path[i];
  }
}

std::optional<ErrorReport> read_error_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  ErrorReport r;
  if (!S_ISREG(st.st_mode)) {
    r.problem = "it is not a regular file";
    return r;
  }
  if (static_cast<size_t>(st.st_size) > kMaxFileBytes) {
    r.problem = "it is larger than 1 MiB (" + std::to_string(st.st_size) + " bytes)";
    return r;
  }
  std::ifstream in(path, std::ios::binary);
  std::string text;
  text.reserve(static_cast<size_t>(st.st_size));
  std::copy_n(std::istreambuf_iterator<char>(in), static_cast<size_t>(st.st_size), std::back_inserter(text));
  if (!in && text.size() < static_cast<size_t>(st.st_size)) {
    r.problem = "it could not be read";
    return r;
  }
  return parse(text);
}

ErrorFiles::ErrorFiles(const Options& options) {
  if (!options.log_dir.empty()) {
    base_ = options.log_dir + "/" + options.rdzv_id;
    return;
  }
  const char* tmp = ::getenv("TMPDIR");  // dtrain-run's own choice of scratch space, as mkdtemp users do
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/dtrain-run-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) return;  // no error files; failures still get summaries
  base_ = tmpl;
  temporary_ = true;
}

ErrorFiles::~ErrorFiles() {
  if (temporary_) ::nftw(base_.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

std::string ErrorFiles::prepare(int attempt, int local_rank) const {
  if (base_.empty()) return "";
  const std::string dir = base_ + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(local_rank);
  make_dirs(dir);
  const std::string path = dir + "/error.json";
  ::unlink(path.c_str());
  return path;
}

}  // namespace dtrain::run
