#pragma once

// Fashion-MNIST (Zalando; 28x28 grayscale images of 10 clothing classes) as
// a libtorch dataset, read from the gzip IDX files of Debian's
// `dataset-fashion-mnist` package:
//
//   dtrain::FashionMNIST train;                                   // default root, kTrain
//   dtrain::FashionMNIST test(dtrain::FashionMNIST::kDefaultRoot,
//                             dtrain::FashionMNIST::Mode::kTest);
//   auto loader = torch::data::make_data_loader(
//       train.map(torch::data::transforms::Stack<>()), sampler, options);
//
// Files under root: train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz
// (60000 samples), t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz
// (10000 samples). The constructor reads the mode's two files completely
// (about 0.3 s for the training set) and validates them: magic numbers
// (2051 images, 2049 labels), 28x28 images, the mode's sample count in both
// files, no missing or extra bytes, labels in 0..9. Any violation, a missing
// directory or file, or corrupt gzip data throws dtrain::InvalidArgument
// naming the file and what was expected, e.g.
//   /data/t10k-labels-idx1-ubyte.gz: expected magic 2049 (IDX labels), found 1234
//   /data/t10k-labels-idx1-ubyte.gz: file ends after 1000 of 10000 labels
//
// Copies share the tensors (as libtorch's data loader makes one copy per
// worker thread); get() is safe to call from several threads.

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <cstddef>
#include <string>

#include "dtrain/arg.h"

namespace dtrain {

struct FashionMNISTOptions {
  // Off (default): pixels scaled to [0, 1], as torchvision's ToTensor().
  // On: then (x - mean) / std, with Fashion-MNIST's usual training-set
  // statistics below.
  DTRAIN_ARG(bool, normalize) = false;
  DTRAIN_ARG(double, mean) = 0.2860;
  DTRAIN_ARG(double, std) = 0.3530;
};

class FashionMNIST : public torch::data::datasets::Dataset<FashionMNIST> {
 public:
  enum class Mode { kTrain, kTest };
  static constexpr const char* kDefaultRoot = "/usr/share/datasets/fashion-mnist";
  static constexpr int64_t kTrainSize = 60000;
  static constexpr int64_t kTestSize = 10000;
  static constexpr int64_t kRows = 28;
  static constexpr int64_t kColumns = 28;
  static constexpr int64_t kClasses = 10;

  explicit FashionMNIST(const std::string& root = kDefaultRoot, Mode mode = Mode::kTrain,
                        const FashionMNISTOptions& options = FashionMNISTOptions());

  // Image `index`: float [1, 28, 28] (a view into images()); label: int64
  // scalar in 0..9. Throws InvalidArgument for an index past the end.
  torch::data::Example<> get(size_t index) override;
  torch::optional<size_t> size() const override;

  // Every image, float [N, 1, 28, 28], scaled (and normalized) as get()
  // returns them; shared, not copied.
  const torch::Tensor& images() const { return images_; }
  // Every label, int64 [N].
  const torch::Tensor& targets() const { return targets_; }
  Mode mode() const { return mode_; }

 private:
  torch::Tensor images_;
  torch::Tensor targets_;
  Mode mode_;
};

}  // namespace dtrain
