#include "store/agent_store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "common/enforce.h"
#include "common/torch_compat.h"
#include "common/socket.h"

namespace dtrain {
namespace {

class AgentStore final : public Store {
 public:
  AgentStore(std::unique_ptr<c10d::TCPStore> store, std::string endpoint,
             std::chrono::milliseconds timeout)
      : Store(timeout), store_(std::move(store)), endpoint_(std::move(endpoint)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    call([&] { store_->set(key, value); });
  }
  using Store::set;
  // The wait carries this store's timeout itself: c10d's get() would use
  // the c10d store's own timeout, and setting that on every call (as this
  // did) changed it under every other thread's calls, unsynchronized.
  std::vector<uint8_t> get(const std::string& key) override {
    std::vector<uint8_t> value;
    call([&] {
      store_->wait({key}, timeout());
      value = store_->get(key);
    }, key);
    return value;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t value = 0;
    call([&] { value = store_->add(key, delta); });
    return value;
  }
  std::vector<uint8_t> compare_set(const std::string& key, const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired) override {
    std::vector<uint8_t> value;
    call([&] { value = store_->compareSet(key, expected, desired); });
    return value;
  }
  bool check(const std::vector<std::string>& keys) override {
    bool ok = false;
    call([&] { ok = store_->check(keys); });
    return ok;
  }
  bool delete_key(const std::string& key) override {
    bool ok = false;
    call([&] { ok = store_->deleteKey(key); });
    return ok;
  }
  int64_t num_keys() override {
    int64_t n = 0;
    call([&] { n = store_->getNumKeys(); });
    return n;
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    call([&] { store_->wait(keys, timeout); }, detail::join(keys));
  }
  using Store::wait;

 private:
  // c10d reports everything as c10::Error (timeouts say "Timeout" or
  // "timed out"); give it dtrain's types and name the store.
  template <typename F>
  void call(F&& f, const std::string& keys = "") {
    try {
      f();
    } catch (const c10::Error& e) {
      std::string msg = e.what_without_backtrace();
      std::string where = "torchrun agent store " + endpoint_ +
                          (keys.empty() ? "" : " (key " + keys + ")");
      if (msg.find("imeout") != std::string::npos || msg.find("timed out") != std::string::npos)
        throw TimeoutError(where + ": " + msg);
      throw NetworkError(where + ": " + msg);
    }
  }

  std::unique_ptr<c10d::TCPStore> store_;
  std::string endpoint_;
};

}  // namespace

std::shared_ptr<Store> connect_agent_store(const std::string& host, uint16_t port,
                                           std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  compat::disable_libuv(opts);
  const auto endpoint = net::endpoint(host, port);
  try {
    return std::make_shared<AgentStore>(std::make_unique<c10d::TCPStore>(host, opts), endpoint,
                                        timeout);
  } catch (const c10::Error& e) {
    throw NetworkError(detail::cat("could not connect to torchrun's agent store at ", endpoint,
                                   " (TORCHELASTIC_USE_AGENT_STORE=True): ",
                                   e.what_without_backtrace()));
  }
}

}  // namespace dtrain
