#pragma once

// A store whose waits give up as soon as there is no point in waiting: the
// rendezvous of a cross-replica group with a member the lighthouse
// declared dead ends at once, not at the group's timeout. Torch-free.

#include <functional>
#include <memory>
#include <string>

#include "dtrain/store/store.h"

namespace dtrain::ft {

class AbandonableStore final : public Store {
 public:
  // `abandoned`: why waiting is pointless now, or "" while it is not; asked
  // every `slice` of a wait (and of a get, which waits for its key).
  // A wait given up throws NetworkError naming that reason.
  AbandonableStore(std::shared_ptr<Store> inner, std::function<std::string()> abandoned,
                   std::chrono::milliseconds slice);

  void set(const std::string& key, const std::vector<uint8_t>& value) override { inner_->set(key, value); }
  using Store::set;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override { return inner_->add(key, delta); }
  std::vector<uint8_t> compare_set(const std::string& key, const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired) override {
    return inner_->compare_set(key, expected, desired);
  }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  bool delete_key(const std::string& key) override { return inner_->delete_key(key); }
  int64_t num_keys() override { return inner_->num_keys(); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  using Store::wait;
  void set_timeout(std::chrono::milliseconds timeout) override;

 private:
  std::shared_ptr<Store> inner_;
  std::function<std::string()> abandoned_;
  std::chrono::milliseconds slice_;
};

}  // namespace dtrain::ft
