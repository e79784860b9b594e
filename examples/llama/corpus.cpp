#include "corpus.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace llama {
namespace {

bool ends_with(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

std::vector<std::string> text_files(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    struct stat st {};
    if (name[0] == '.' || ends_with(name, ".dat") || ends_with(name, ".u8")) continue;
    if (lstat((dir + "/" + name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) names.push_back(name);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

Corpus::Corpus(const std::string& dir) {
  std::string text;
  for (const auto& name : text_files(dir)) {
    std::ifstream in(dir + "/" + name, std::ios::binary);
    std::stringstream content;
    content << in.rdbuf();
    std::string lines = content.str();
    for (size_t at = 0; (at = lines.find("\n%\n", at)) != std::string::npos;) lines.replace(at, 3, "\n\n");
    text += lines;
    ++files_;
  }
  if (text.size() < 4096)
    throw std::runtime_error("no training text in " + dir + " (" + std::to_string(text.size()) +
                             " bytes in " + std::to_string(files_) +
                             " files): install Debian's fortunes package (apt-get install fortunes) "
                             "or give --corpus a directory of text files");
  bytes_ = torch::empty({static_cast<int64_t>(text.size())}, torch::kUInt8);
  std::copy(text.begin(), text.end(), bytes_.data_ptr<uint8_t>());
}

at::Tensor Corpus::batch(uint64_t seed, int64_t step, int64_t rows, int64_t length) const {
  auto gen = at::detail::createCPUGenerator(seed * 7919 + static_cast<uint64_t>(step));
  const auto starts = at::randint(size() - length - 1, {rows}, gen, torch::kLong);
  const auto offsets = torch::arange(length + 1, torch::kLong);
  return bytes_.index({starts.unsqueeze(1) + offsets}).to(torch::kLong);
}

std::string printable(const std::string& bytes) {
  std::string out;
  for (const unsigned char c : bytes) {
    if (c == '\n' || (c >= 32 && c < 127)) {
      out += static_cast<char>(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      out += hex;
    }
  }
  return out;
}

}  // namespace llama
