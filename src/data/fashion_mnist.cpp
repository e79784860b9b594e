#include "dtrain/data/fashion_mnist.h"

#include "common/enforce.h"
#include "common/paths.h"
#include "data/idx_file.h"

namespace dtrain {
namespace {

std::string join_path(const std::string& root, const char* name) {
  return paths::join(root, name);
}

void check_root(const std::string& root) {
  DTRAIN_CHECK_ARG(paths::exists(root), "FashionMNIST: dataset directory '", root,
                   "' does not exist; install Debian's dataset-fashion-mnist package "
                   "(scripts/setup.sh) or pass the directory holding the *-idx?-ubyte.gz files");
  DTRAIN_CHECK_ARG(paths::is_directory(root), "FashionMNIST: dataset root '", root,
                   "' is not a directory");
}

// The first label outside 0..9, named with its file and index: a label byte
// out of range means a corrupt or foreign file, and would otherwise surface
// much later as an index error inside the loss.
void check_labels(const at::Tensor& labels, const std::string& path) {
  const auto bad = (labels >= FashionMNIST::kClasses).nonzero();
  if (bad.numel() == 0) return;
  const int64_t index = bad[0][0].item<int64_t>();
  throw InvalidArgument(detail::cat(path, ": label ", int(labels[index].item<uint8_t>()),
                                    " at index ", index, " is outside 0..",
                                    FashionMNIST::kClasses - 1));
}

}  // namespace

FashionMNIST::FashionMNIST(const std::string& root, Mode mode, const FashionMNISTOptions& options)
    : mode_(mode) {
  check_root(root);
  const bool train = mode == Mode::kTrain;
  const int64_t count = train ? kTrainSize : kTestSize;
  const std::string images_path =
      join_path(root, train ? "train-images-idx3-ubyte.gz" : "t10k-images-idx3-ubyte.gz");
  const std::string labels_path =
      join_path(root, train ? "train-labels-idx1-ubyte.gz" : "t10k-labels-idx1-ubyte.gz");

  // Labels first: the small file fails fast when the directory is wrong.
  const at::Tensor labels =
      data::read_idx_gz(labels_path, {data::kIdxLabelsMagic, "labels", count, {}});
  check_labels(labels, labels_path);
  const at::Tensor pixels =
      data::read_idx_gz(images_path, {data::kIdxImagesMagic, "images", count, {kRows, kColumns}});
  // Both files were checked against the same count; kept as an invariant
  // so a future relaxation of the count check cannot pair them wrongly.
  DTRAIN_CHECK_ARG(pixels.size(0) == labels.size(0), images_path, " holds ", pixels.size(0),
                   " images but ", labels_path, " holds ", labels.size(0), " labels");

  images_ = pixels.unsqueeze(1).to(at::kFloat).div_(255.0);
  if (options.normalize()) {
    DTRAIN_CHECK_ARG(options.std() > 0, "FashionMNIST: normalization std must be positive, got ",
                     options.std());
    images_.sub_(options.mean()).div_(options.std());
  }
  targets_ = labels.to(at::kLong);
}

torch::data::Example<> FashionMNIST::get(size_t index) {
  const auto n = static_cast<size_t>(images_.size(0));
  DTRAIN_CHECK_ARG(index < n, "FashionMNIST::get: index ", index, " is out of range for ", n,
                   " samples");
  const auto i = static_cast<int64_t>(index);
  return {images_[i], targets_[i]};
}

torch::optional<size_t> FashionMNIST::size() const {
  return static_cast<size_t>(images_.size(0));
}

}  // namespace dtrain
