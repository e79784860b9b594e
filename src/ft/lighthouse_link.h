#pragma once

// A replica's side of the lighthouse (dtrain/ft/lighthouse.h): its store
// connection (requests; the cross-replica groups' rendezvous), made again
// after a failure, and the heartbeats of the replica's first rank.
// Torch-free.

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "dtrain/store/tcp_store.h"
#include "ft/protocol.h"

namespace dtrain {
class TcpStoreClient;
}

namespace dtrain::ft {

struct LighthouseAddress {
  std::string host;
  uint16_t port = 0;
  std::string text() const;
};
// "host:port" or "[v6]:port"; InvalidArgument naming `what` otherwise.
LighthouseAddress parse_lighthouse_address(const std::string& text, const std::string& what);

class LighthouseLink {
 public:
  LighthouseLink(LighthouseAddress address, std::string token, std::chrono::milliseconds timeout);

  // The connection, made now if there is none. Throws NetworkError /
  // TimeoutError "the lighthouse at H:P is unreachable or refused this
  // replica: ..." (the job token among the reasons) or
  // InvalidArgument when what answers is not a lighthouse.
  std::shared_ptr<TcpStore> store(std::chrono::milliseconds connect_timeout);
  // Forgets the connection (after an error on it): the next call makes one.
  void reset();
  // One request and its answer, waiting at most `quorum_timeout`.
  protocol::Answer ask(const protocol::Request& request, std::chrono::milliseconds connect_timeout,
                       std::chrono::milliseconds quorum_timeout);
  const LighthouseAddress& address() const { return address_; }

 private:
  LighthouseAddress address_;
  std::string token_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::shared_ptr<TcpStore> store_;
};

// Registers the replica with the lighthouse (so that a quorum waits for
// it before it first asks), then adds to its heartbeat counter every
// `interval` on a thread of its own, over a connection of its own (a
// request waiting for its quorum never holds a heartbeat back). That
// connection holds the replica's presence key (protocol::present_key) as
// an ephemeral key: when the process ends, however it ends, the lighthouse
// knows at once. A failed beat drops the connection and the next one
// connects again (and sets the key again).
class Heartbeat {
 public:
  Heartbeat(LighthouseAddress address, std::string token, std::string replica,
            std::chrono::milliseconds interval);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  void run();
  void beat();
  LighthouseAddress address_;
  std::optional<std::string> token_;
  std::unique_ptr<TcpStoreClient> client_;  // the heartbeat's connection; null after a failure
  bool registered_ = false;                 // with this connection's lighthouse
  std::string replica_;
  std::string key_;
  std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

// Watches for the lighthouse's verdict on one quorum (protocol::dead_key)
// every `interval`, on a thread of its own over a connection of its own,
// and calls `on_deaths` once per quorum that has one, on that thread. A
// verdict that does not parse is logged and ignored; a lighthouse that is
// away is tried again at the next look.
class DeathWatch {
 public:
  using OnDeaths = std::function<void(const std::string& quorum_id, const std::vector<protocol::Death>&)>;
  DeathWatch(LighthouseAddress address, std::string token, std::chrono::milliseconds interval, OnDeaths on_deaths);
  ~DeathWatch();
  DeathWatch(const DeathWatch&) = delete;
  DeathWatch& operator=(const DeathWatch&) = delete;

  // Watch this quorum from now on (in place of the one before).
  void watch(const std::string& quorum_id);

 private:
  void run();
  void look(const std::string& quorum_id);
  LighthouseLink link_;
  std::chrono::milliseconds interval_;
  OnDeaths on_deaths_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::string quorum_;  // empty: nothing to watch
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dtrain::ft
