#pragma once

// Decorator that puts every key under "<prefix>/", so several groups (or
// several restarts of one job) share a store without clashing.

#include "dtrain/store/store.h"

namespace dtrain {

class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> inner);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  using Store::set;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::vector<uint8_t> compare_set(const std::string& key,
                                   const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  // Counts the keys of the whole inner store, as torch's PrefixStore does.
  int64_t num_keys() override;
  void wait(const std::vector<std::string>& keys,
            std::chrono::milliseconds timeout) override;
  using Store::wait;
  void set_timeout(std::chrono::milliseconds timeout) override;

  const std::shared_ptr<Store>& inner() const { return inner_; }
  const std::string& prefix() const { return prefix_; }

 private:
  std::string key(const std::string& k) const { return prefix_ + "/" + k; }
  std::vector<std::string> keys(const std::vector<std::string>& ks) const;
  std::string prefix_;
  std::shared_ptr<Store> inner_;
};

}  // namespace dtrain
