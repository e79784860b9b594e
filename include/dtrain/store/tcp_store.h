#pragma once

// TCP store: one rank (usually rank 0) runs the server, every rank (the
// server's own rank included) talks to it through a client connection.
//
// Wire format (docs/design/store-protocol.md): every frame starts with a
// 16-byte header {magic "DTRS", version, opcode, payload length}; the server
// rejects a frame with the wrong magic or version, or a declared length over
// kMaxFrameBytes, by closing that connection — without touching other
// clients and without allocating for the declared length. The server is a
// single poll() loop with non-blocking sockets, so a slow or idle client
// never delays the others.
//
// The server binds only to the address it is given (never to all interfaces
// unless host is "0.0.0.0" or "::" explicitly). With a job token it serves
// only connections that prove they hold it (HMAC-SHA256 challenge and
// response); the token never crosses the wire.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/arg.h"
#include "dtrain/store/store.h"

namespace dtrain {

struct TcpStoreOptions {
  DTRAIN_ARG(std::string, host) = "127.0.0.1";
  // 0 with is_server: pick a free port (read it back with TcpStore::port()).
  DTRAIN_ARG(uint16_t, port) = 29500;
  DTRAIN_ARG(bool, is_server) = false;
  // With num_workers > 0 the constructor waits until that many clients
  // (this one included) have connected, or fails with "x/y joined".
  DTRAIN_ARG(int, num_workers) = 0;
  DTRAIN_ARG(bool, wait_workers) = true;
  // Timeout of every blocking call, connecting included.
  DTRAIN_ARG(std::chrono::milliseconds, timeout) = Store::kDefaultTimeout;
  // The job token (docs/security.md): the server serves only connections
  // that prove they hold it, and the client proves it. Empty: the token of
  // DTRAIN_STORE_TOKEN or DTRAIN_STORE_TOKEN_FILE, or none when both are
  // unset (then a server on an address other than loopback warns once that
  // anyone who can reach it can read and write its keys).
  DTRAIN_ARG(std::string, token) = "";
};

class TcpStoreServer;
class TcpStoreClient;

class TcpStore : public Store {
 public:
  static constexpr uint32_t kMaxFrameBytes = 64u << 20;

  explicit TcpStore(const TcpStoreOptions& options);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  using Store::set;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::vector<uint8_t> compare_set(const std::string& key,
                                   const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  void wait(const std::vector<std::string>& keys,
            std::chrono::milliseconds timeout) override;
  using Store::wait;

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }

 private:
  std::string host_;
  uint16_t port_;
  std::unique_ptr<TcpStoreServer> server_;  // set on the hosting rank only
  std::unique_ptr<TcpStoreClient> client_;
};

}  // namespace dtrain
