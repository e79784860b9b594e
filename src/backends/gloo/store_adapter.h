#pragma once

// Lets Gloo's rendezvous (connectFullMesh) exchange addresses through any
// dtrain Store.

#include <gloo/rendezvous/store.h>

#include <memory>

#include "dtrain/store/store.h"

namespace dtrain::gloo_backend {

class StoreAdapter : public ::gloo::rendezvous::Store {
 public:
  explicit StoreAdapter(std::shared_ptr<dtrain::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  std::shared_ptr<dtrain::Store> store_;
};

}  // namespace dtrain::gloo_backend
