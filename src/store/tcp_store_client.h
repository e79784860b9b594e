#pragma once

// The TCP store's client: one connection to the server, one request in
// flight at a time (a mutex makes it safe to share between threads).
//
// Contract:
//  - Every call takes the timeout it runs under. For GET and WAIT that is
//    how long the server waits for the keys; the client then waits for the
//    reply that long plus kReplyGrace, so a server that died or stopped
//    answering becomes a TimeoutError instead of a hang.
//  - After any failure (timeout, closed connection, protocol error) the
//    socket is closed; the next call reconnects. A late reply to an
//    abandoned request can therefore never be read as the answer to a
//    later one.
//  - Errors name the server's host:port and the key(s):
//    TimeoutError, NetworkError, or InvalidArgument for requests the store
//    refuses (key over 64 KiB, frame over TcpStore::kMaxFrameBytes, add()
//    on a non-integer value).

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/socket.h"
#include "store/wire.h"

namespace dtrain {

class TcpStoreClient {
 public:
  static constexpr std::chrono::milliseconds kReplyGrace{2000};

  // Connects (retrying while the server is not up yet) within `timeout`;
  // with a token, proves it (and checks that the server holds it too).
  TcpStoreClient(std::string host, uint16_t port, std::chrono::milliseconds timeout,
                 std::optional<std::string> token = std::nullopt);

  using ms = std::chrono::milliseconds;
  void set(const std::string& key, const std::vector<uint8_t>& value, ms timeout);
  // A key deleted by the server when this connection closes (however it
  // closes: a failure here, or the process's end, drops it; set it again
  // after a failed call, which reconnects).
  void set_ephemeral(const std::string& key, const std::vector<uint8_t>& value, ms timeout);
  std::vector<uint8_t> get(const std::string& key, ms timeout);
  int64_t add(const std::string& key, int64_t delta, ms timeout);
  std::vector<uint8_t> compare_set(const std::string& key, const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired, ms timeout);
  bool check(const std::vector<std::string>& keys, ms timeout);
  bool delete_key(const std::string& key, ms timeout);
  int64_t num_keys(ms timeout);
  void wait(const std::vector<std::string>& keys, ms timeout);

 private:
  // Sends one request frame (filling in its request id) and reads the
  // reply; an OK reply's payload is handed to `parse` while the connection
  // is still held. `blocking` requests (GET, WAIT) get `timeout` +
  // kReplyGrace for the reply; `what` describes the request for error
  // messages ("GET of key 'foo'"). Returns the reply's status (OK or
  // TIMEOUT); an ERROR reply throws InvalidArgument.
  uint16_t call(std::vector<uint8_t> frame, ms timeout, bool blocking, const std::string& what,
                const std::function<void(wire::Reader&)>& parse);
  void connect(ms timeout);
  // One request and its reply on a fresh connection, before `deadline`.
  wire::Header exchange(const std::vector<uint8_t>& frame, std::vector<uint8_t>* body,
                        net::Clock::time_point deadline);
  void prove_token(net::Clock::time_point deadline);
  // Reads a REFUSED frame's reason and throws it as a NetworkError.
  [[noreturn]] void refused(const wire::Header& h, net::Clock::time_point deadline);

  std::string host_;
  uint16_t port_;
  std::string where_;  // "host:port"
  std::optional<std::string> token_;
  std::mutex mutex_;
  net::Fd fd_;
  uint32_t next_request_id_ = 1;
};

}  // namespace dtrain
