#include "dtrain/store/tcp_store.h"

#include <mutex>

#include "common/enforce.h"
#include "common/logging.h"
#include "store/auth.h"
#include "store/store_util.h"
#include "store/tcp_store_client.h"
#include "store/tcp_store_server.h"

// TcpStore is the public face: it owns the server on the hosting rank and
// forwards every call to its client, passing the store's current timeout
// (which set_timeout() may change at any time).
//
// Worker counting: with num_workers > 0 every TcpStore adds 1 to an internal
// counter once connected; the one that brings it to num_workers sets a
// second internal "ready" key. The hosting rank then waits for that key with
// an ordinary server-side WAIT, so counting needs no opcode of its own.

namespace dtrain {

namespace {
// Once per process: a store without a token on a network address.
void warn_open_store(const std::string& where) {
  static std::once_flag once;
  std::call_once(once, [&] {
    log_warning(detail::cat("TCP store ", where, " has no job token: anyone who can reach it can "
                            "read and change the job's keys; set DTRAIN_STORE_TOKEN (the same on "
                            "every node) to require one (docs/security.md)"));
  });
}

const std::string kWorkersKey = std::string(store_detail::kInternalPrefix) + "tcp_store_workers";
const std::string kReadyKey = std::string(store_detail::kInternalPrefix) + "tcp_store_ready";
}  // namespace

TcpStore::TcpStore(const TcpStoreOptions& options)
    : Store(options.timeout()), host_(options.host()), port_(options.port()) {
  const std::string where = net::endpoint(host_, port_);
  DTRAIN_CHECK_ARG(!host_.empty(), "TcpStore: host is empty");
  DTRAIN_CHECK_ARG(options.is_server() || port_ != 0, "TcpStore ", where,
                   ": port 0 (pick a free port) is only valid with is_server(true)");
  DTRAIN_CHECK_ARG(options.num_workers() >= 0, "TcpStore ", where, ": num_workers=",
                   options.num_workers(), " is negative");
  DTRAIN_CHECK_ARG(options.timeout().count() >= 0, "TcpStore ", where, ": timeout of ",
                   options.timeout().count(), " ms is negative");

  std::optional<std::string> token;
  if (!options.token().empty())
    token = options.token();
  else
    token = store_auth::token_from_environment();
  if (options.is_server()) {
    server_ = std::make_unique<TcpStoreServer>(host_, port_, TcpStoreServer::Limits::from_environment(),
                                               token);
    port_ = server_->port();
    if (!token && !net::is_loopback(host_)) warn_open_store(net::endpoint(host_, port_));
  }
  client_ = std::make_unique<TcpStoreClient>(host_, port_, timeout(), token);

  const int workers = options.num_workers();
  if (workers == 0) return;
  if (client_->add(kWorkersKey, 1, timeout()) == workers)
    client_->set(kReadyKey, {'1'}, timeout());
  if (!options.is_server() || !options.wait_workers()) return;
  try {
    client_->wait({kReadyKey}, timeout());
  } catch (const TimeoutError&) {
    const int64_t joined = client_->add(kWorkersKey, 0, timeout());
    throw TimeoutError(detail::cat("TCP store ", net::endpoint(host_, port_),
                                   ": timed out after ", timeout().count(),
                                   " ms waiting for workers: ", joined, "/", workers,
                                   " joined"));
  }
}

// The client goes first (members are destroyed in reverse order, and
// server_ is declared before client_), so the server never sees this
// rank's connection drop as a failure.
TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  client_->set(key, value, timeout());
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  return client_->get(key, timeout());
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  return client_->add(key, delta, timeout());
}

std::vector<uint8_t> TcpStore::compare_set(const std::string& key,
                                           const std::vector<uint8_t>& expected,
                                           const std::vector<uint8_t>& desired) {
  return client_->compare_set(key, expected, desired, timeout());
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  return client_->check(keys, timeout());
}

bool TcpStore::delete_key(const std::string& key) {
  return client_->delete_key(key, timeout());
}

int64_t TcpStore::num_keys() { return client_->num_keys(timeout()); }

void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  client_->wait(keys, timeout);
}

}  // namespace dtrain
