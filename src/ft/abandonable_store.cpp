#include "ft/abandonable_store.h"

#include <algorithm>

#include "common/enforce.h"

namespace dtrain::ft {

AbandonableStore::AbandonableStore(std::shared_ptr<Store> inner, std::function<std::string()> abandoned,
                                   std::chrono::milliseconds slice)
    : Store(inner->timeout()), inner_(std::move(inner)), abandoned_(std::move(abandoned)), slice_(slice) {}

void AbandonableStore::set_timeout(std::chrono::milliseconds timeout) {
  Store::set_timeout(timeout);
  inner_->set_timeout(timeout);
}

std::vector<uint8_t> AbandonableStore::get(const std::string& key) {
  wait({key}, timeout());
  return inner_->get(key);
}

void AbandonableStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (auto why = abandoned_(); !why.empty())
      throw NetworkError(detail::cat("waiting for ", keys.size() == 1 ? "key '" + keys[0] + "'" : "keys",
                                     " was given up: ", why));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      return inner_->wait(keys, std::clamp(left, std::chrono::milliseconds(1), slice_));
    } catch (const TimeoutError&) {
      if (left <= slice_)
        throw TimeoutError(detail::cat("waited ", timeout.count(), " ms for ",
                                       keys.size() == 1 ? "key '" + keys[0] + "'" : "keys", " in vain"));
    }
  }
}

}  // namespace dtrain::ft
