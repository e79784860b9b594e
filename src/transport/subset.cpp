#include "transport/subset.h"

#include <algorithm>

#include "common/enforce.h"

namespace dtrain::transport {
namespace {

// The base's request, with its source told in the view's ranks.
class SubsetRequest final : public Request {
 public:
  SubsetRequest(RequestPtr base, std::vector<int> ranks) : base_(std::move(base)), ranks_(std::move(ranks)) {}
  void wait(Clock::time_point deadline, const std::string& what) override {
    base_->wait(deadline, what);
  }
  int source() const override {
    const int s = base_->source();
    auto it = std::find(ranks_.begin(), ranks_.end(), s);
    return it == ranks_.end() ? -1 : static_cast<int>(it - ranks_.begin());
  }
  bool done() const override { return base_->done(); }
  void on_done(std::function<void()> fn) override { base_->on_done(std::move(fn)); }

 private:
  RequestPtr base_;
  const std::vector<int> ranks_;
};

}  // namespace

Subset::Subset(Transport& base, std::vector<int> ranks) : base_(base), ranks_(std::move(ranks)) {
  auto it = std::find(ranks_.begin(), ranks_.end(), base.rank());
  DTRAIN_ENFORCE(it != ranks_.end());
  rank_ = static_cast<int>(it - ranks_.begin());
}

int Subset::base_rank(int peer) const {
  DTRAIN_CHECK_ARG(peer >= 0 && peer < size(), "transport subset: peer ", peer, " of ", size());
  return ranks_[peer];
}

RequestPtr Subset::isend(int peer, uint64_t tag, const void* data, size_t bytes) {
  return base_.isend(base_rank(peer), tag, data, bytes);
}

RequestPtr Subset::irecv(int peer, uint64_t tag, void* data, size_t bytes) {
  return base_.irecv(base_rank(peer), tag, data, bytes);
}

RequestPtr Subset::irecv_any(uint64_t tag, void* data, size_t bytes) {
  return std::make_shared<SubsetRequest>(base_.irecv_any(tag, data, bytes), ranks_);
}

}  // namespace dtrain::transport
