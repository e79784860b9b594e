#pragma once

// A view of some ranks of a transport as a transport of their own: rank i of
// the view is ranks[i] of the base. Algorithms written for a whole group
// (algorithms/) then run inside a host or across hosts of it (the two-level
// all_reduce). Tags pass through unchanged: callers keep the phases apart
// with tags of their own. Failing or closing the view fails the base: one
// group, one fate. No torch here.

#include <vector>

#include "transport/transport.h"

namespace dtrain::transport {

class Subset final : public Transport {
 public:
  // `ranks`: base ranks, the base's own rank among them.
  Subset(Transport& base, std::vector<int> ranks);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override;
  // The base matches a message from any of its ranks: use a tag that only
  // the view's ranks send with. source() is -1 for a rank outside the view.
  RequestPtr irecv_any(uint64_t tag, void* data, size_t bytes) override;
  void fail(std::exception_ptr error) override { base_.fail(error); }
  void close(std::exception_ptr error) override { base_.close(error); }
  std::exception_ptr error() const override { return base_.error(); }

 private:
  int base_rank(int peer) const;
  Transport& base_;
  std::vector<int> ranks_;
  int rank_ = -1;
};

}  // namespace dtrain::transport
