#include "transport/tcp/socket_link.h"

#include <fcntl.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/enforce.h"
#include "common/logging.h"

namespace dtrain::transport::tcp {

SocketLink::SocketLink(net::Fd fd) : fd_(std::move(fd)) {
  fcntl(fd_.get(), F_SETFL, fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
}

ssize_t SocketLink::read(void* dst, size_t n) {
  return ::recv(fd_.get(), dst, n, MSG_DONTWAIT);
}

ssize_t SocketLink::write(const iovec* iov, int count) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(count);
  return ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

void SocketLink::end_output() { ::shutdown(fd_.get(), SHUT_WR); }
void SocketLink::abort() { ::shutdown(fd_.get(), SHUT_RDWR); }

bool SocketLink::delivered() const {
  int unacknowledged = 0;  // bytes (and the FIN) the peer's kernel has not acknowledged
  return ::ioctl(fd_.get(), SIOCOUTQ, &unacknowledged) == 0 && unacknowledged == 0;
}

EpollPoller::EpollPoller() {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) throw NetworkError(detail::cat("tcp: epoll_create1 failed: ", strerror(errno)));
  stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd_ < 0) {
    ::close(epoll_fd_);
    throw NetworkError(detail::cat("tcp: eventfd failed: ", strerror(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // the stop signal
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, stop_fd_, &ev);
}

EpollPoller::~EpollPoller() {
  ::close(epoll_fd_);
  ::close(stop_fd_);
}

void EpollPoller::add(Link& link, void* key) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = key;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, dynamic_cast<SocketLink&>(link).fd(), &ev);
}

void EpollPoller::watch(Link& link, void* key, bool in, bool out) {
  epoll_event ev{};
  ev.events = (in ? EPOLLIN : 0u) | (out ? EPOLLOUT : 0u);
  ev.data.ptr = key;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, dynamic_cast<SocketLink&>(link).fd(), &ev);
}

void EpollPoller::remove(Link& link) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, dynamic_cast<SocketLink&>(link).fd(), nullptr);
}

bool EpollPoller::wait(std::vector<Ready>& ready) {
  epoll_event events[64];
  ready.clear();
  for (;;) {
    const int n = epoll_wait(epoll_fd_, events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      log_warning(detail::cat("tcp: epoll_wait failed: ", strerror(errno)));
      return false;
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.ptr == nullptr) return false;  // stopped
      uint32_t e = 0;
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) e |= kIn;
      if (events[i].events & EPOLLOUT) e |= kOut;
      ready.push_back({events[i].data.ptr, e});
    }
    return true;
  }
}

void EpollPoller::stop() {
  const uint64_t one = 1;
  (void)!::write(stop_fd_, &one, sizeof(one));
}

}  // namespace dtrain::transport::tcp
