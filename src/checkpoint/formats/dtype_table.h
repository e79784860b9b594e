#pragma once

// A file format's element types beside torch's, as one table of pairs that
// is looked up either way.

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <optional>
#include <utility>

namespace dtrain::checkpoint {

template <typename FileType, size_t N>
std::optional<FileType> file_type_of(const std::pair<at::ScalarType, FileType> (&table)[N],
                                     at::ScalarType type) {
  for (const auto& [torch_type, file_type] : table)
    if (torch_type == type) return file_type;
  return std::nullopt;
}

template <typename FileType, size_t N>
std::optional<at::ScalarType> torch_type_of(const std::pair<at::ScalarType, FileType> (&table)[N],
                                            FileType type) {
  for (const auto& [torch_type, file_type] : table)
    if (file_type == type) return torch_type;
  return std::nullopt;
}

}  // namespace dtrain::checkpoint
