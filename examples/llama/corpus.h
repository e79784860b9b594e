#pragma once

// The training text: every fortune file Debian's fortunes packages install
// (/usr/share/games/fortunes, about 4 MB of English), as bytes. A step's
// batch is a function of the seed and the step alone, so every layout of
// the same global batch trains on the same sequences, and a resumed run
// continues with the batches it would have had.

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace llama {

class Corpus {
 public:
  // The regular files of `dir` (not the .dat indexes, not the .u8
  // symlinks), in name order, the "%" lines between fortunes made blank
  // lines. Throws std::runtime_error naming `dir` when it holds no text.
  explicit Corpus(const std::string& dir);

  // `rows` sequences of `length` + 1 bytes (input and the target shifted by
  // one) at positions drawn from (seed, step): [rows, length + 1], int64.
  at::Tensor batch(uint64_t seed, int64_t step, int64_t rows, int64_t length) const;

  int64_t size() const { return bytes_.numel(); }
  int files() const { return files_; }

 private:
  at::Tensor bytes_;  // uint8
  int files_ = 0;
};

// Text for a terminal: printable ASCII and newlines kept, other bytes as \xNN.
std::string printable(const std::string& bytes);

}  // namespace llama
