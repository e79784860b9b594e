#include "dtrain/store/prefix_store.h"

#include "common/enforce.h"

namespace dtrain {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> inner)
    : Store(inner ? inner->timeout() : kDefaultTimeout),
      prefix_(std::move(prefix)),
      inner_(std::move(inner)) {
  DTRAIN_CHECK_ARG(inner_ != nullptr, "PrefixStore('", prefix_, "'): the inner store is null");
}

std::vector<std::string> PrefixStore::keys(const std::vector<std::string>& ks) const {
  std::vector<std::string> out;
  out.reserve(ks.size());
  for (const auto& k : ks) out.push_back(key(k));
  return out;
}

void PrefixStore::set(const std::string& k, const std::vector<uint8_t>& value) {
  inner_->set(key(k), value);
}

std::vector<uint8_t> PrefixStore::get(const std::string& k) { return inner_->get(key(k)); }

int64_t PrefixStore::add(const std::string& k, int64_t delta) {
  return inner_->add(key(k), delta);
}

std::vector<uint8_t> PrefixStore::compare_set(const std::string& k,
                                              const std::vector<uint8_t>& expected,
                                              const std::vector<uint8_t>& desired) {
  return inner_->compare_set(key(k), expected, desired);
}

bool PrefixStore::check(const std::vector<std::string>& ks) { return inner_->check(keys(ks)); }

bool PrefixStore::delete_key(const std::string& k) { return inner_->delete_key(key(k)); }

int64_t PrefixStore::num_keys() { return inner_->num_keys(); }

void PrefixStore::wait(const std::vector<std::string>& ks, std::chrono::milliseconds timeout) {
  inner_->wait(keys(ks), timeout);
}

// get() runs with the inner store's timeout, so a new timeout must reach it
// (torch's PrefixStore forwards setTimeout the same way).
void PrefixStore::set_timeout(std::chrono::milliseconds timeout) {
  Store::set_timeout(timeout);
  inner_->set_timeout(timeout);
}

}  // namespace dtrain
