#include "ddp/bucket_assignment.h"

#include <map>

#include "common/enforce.h"

namespace dtrain::ddp {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<ParamSlot>& params,
                                                const std::vector<size_t>& order,
                                                size_t first_cap_bytes, size_t cap_bytes) {
  DTRAIN_ENFORCE_EQ(order.size(), params.size());
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    bool closed_one = false;  // has this kind closed a bucket yet?
  };
  std::map<int, Open> open;
  std::vector<std::vector<size_t>> buckets;
  for (size_t index : order) {
    DTRAIN_ENFORCE_LT(index, params.size());
    auto& o = open[params[index].kind];
    o.members.push_back(index);
    o.bytes += params[index].bytes;
    const size_t cap = o.closed_one ? cap_bytes : first_cap_bytes;
    if (o.bytes >= cap) {
      buckets.push_back(std::move(o.members));
      o.members.clear();
      o.bytes = 0;
      o.closed_one = true;
    }
  }
  for (auto& [kind, o] : open)
    if (!o.members.empty()) buckets.push_back(std::move(o.members));
  return buckets;
}

std::vector<size_t> reverse_order(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

}  // namespace dtrain::ddp
