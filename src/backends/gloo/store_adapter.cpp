#include "backends/gloo/store_adapter.h"

namespace dtrain::gloo_backend {

void StoreAdapter::set(const std::string& key, const std::vector<char>& data) {
  store_->set(key, std::vector<uint8_t>(data.begin(), data.end()));
}

std::vector<char> StoreAdapter::get(const std::string& key) {
  auto value = store_->get(key);
  return std::vector<char>(value.begin(), value.end());
}

void StoreAdapter::wait(const std::vector<std::string>& keys) { store_->wait(keys); }

void StoreAdapter::wait(const std::vector<std::string>& keys,
                        const std::chrono::milliseconds& timeout) {
  store_->wait(keys, timeout);
}

}  // namespace dtrain::gloo_backend
