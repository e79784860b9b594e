#pragma once

// The TCP transport's carrier: a connected socket as a Link, and an epoll
// Poller over such sockets (one per stream index, see transport.h).

#include <vector>

#include "common/socket.h"
#include "transport/link.h"

namespace dtrain::transport::tcp {

class SocketLink final : public Link {
 public:
  explicit SocketLink(net::Fd fd);  // makes it non-blocking
  ssize_t read(void* dst, size_t n) override;
  ssize_t write(const iovec* iov, int count) override;
  void end_output() override;
  void abort() override;
  bool delivered() const override;
  int fd() const { return fd_.get(); }

 private:
  net::Fd fd_;
};

// Takes SocketLinks only.
class EpollPoller final : public Poller {
 public:
  EpollPoller();
  ~EpollPoller() override;
  EpollPoller(const EpollPoller&) = delete;
  EpollPoller& operator=(const EpollPoller&) = delete;

  void add(Link& link, void* key) override;
  void watch(Link& link, void* key, bool in, bool out) override;
  void remove(Link& link) override;
  bool wait(std::vector<Ready>& ready) override;
  void stop() override;

 private:
  int epoll_fd_ = -1;
  int stop_fd_ = -1;  // an eventfd: readable once stopped
};

}  // namespace dtrain::transport::tcp
