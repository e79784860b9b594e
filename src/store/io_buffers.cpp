#include "store/io_buffers.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace dtrain::store_detail {

namespace {
// An input buffer keeps its memory while it is at least half used or small.
constexpr size_t kKeepBytes = 64 * 1024;
constexpr int kMaxIov = 64;
}  // namespace

bool IoBudget::try_charge(size_t n) {
  if (n > limit_ || used_ > limit_ - n) return false;
  charge(n);
  return true;
}

void IoBudget::charge(size_t n) {
  used_ += n;
  peak_ = std::max(peak_, used_);
}

void IoBudget::release(size_t n) { used_ -= std::min(n, used_); }

void IoBudget::pin(const SharedBytes& v) {
  if (pins_[v.get()]++ == 0) charge(v->size());
}

void IoBudget::unpin(const SharedBytes& v) {
  auto it = pins_.find(v.get());
  if (it == pins_.end()) return;
  if (--it->second == 0) {
    release(v->size());
    pins_.erase(it);
  }
}

InputBuffer::InputBuffer(InputBuffer&& o) noexcept
    : budget_(o.budget_), buf_(std::move(o.buf_)), cap_(o.cap_), begin_(o.begin_), end_(o.end_) {
  o.cap_ = o.begin_ = o.end_ = 0;
}

bool InputBuffer::reserve(size_t total, size_t most) {
  if (total <= cap_ - begin_) return true;
  if (total <= cap_) {  // room enough once the handled bytes are dropped
    std::memmove(buf_.get(), data(), size());
    end_ -= begin_;
    begin_ = 0;
    return true;
  }
  const size_t doubled = std::max(total, std::min(most, 2 * cap_));
  if (budget_->try_charge(doubled - cap_)) {
    resize_to(doubled);
    return true;
  }
  if (doubled == total || !budget_->try_charge(total - cap_)) return false;
  resize_to(total);
  return true;
}

void InputBuffer::append(const uint8_t* p, size_t n) {
  const size_t total = size() + n;
  if (!reserve(total, SIZE_MAX)) {  // bytes already received are held whatever the budget
    budget_->charge(total - cap_);
    resize_to(total);
  }
  std::memcpy(buf_.get() + end_, p, n);
  end_ += n;
}

// Moves the bytes into a buffer of exactly `cap` bytes (the budget is
// settled by the caller).
void InputBuffer::resize_to(size_t cap) {
  std::unique_ptr<uint8_t[]> other(new uint8_t[cap]);
  if (size() > 0) std::memcpy(other.get(), data(), size());
  end_ -= begin_;
  begin_ = 0;
  buf_ = std::move(other);
  cap_ = cap;
}

void InputBuffer::consume(size_t n) {
  begin_ += std::min(n, size());
  if (empty()) {
    free();
    return;
  }
  if (n > 0 && cap_ > kKeepBytes && size() * 2 < cap_) {  // keep only what is left
    budget_->release(cap_ - size());
    resize_to(size());
  }
}

void InputBuffer::free() {
  buf_.reset();
  if (budget_) budget_->release(cap_);
  cap_ = begin_ = end_ = 0;
}

OutputQueue::OutputQueue(OutputQueue&& o) noexcept
    : budget_(o.budget_), pieces_(std::move(o.pieces_)), front_sent_(o.front_sent_),
      pending_(o.pending_) {
  o.pieces_.clear();
  o.front_sent_ = o.pending_ = 0;
}

void OutputQueue::append(std::vector<uint8_t> bytes) {
  if (bytes.empty()) return;
  budget_->charge(bytes.size());
  pending_ += bytes.size();
  pieces_.push_back(Piece{std::move(bytes), nullptr});
}

void OutputQueue::append(SharedBytes value) {
  if (!value || value->empty()) return;
  budget_->pin(value);
  pending_ += value->size();
  pieces_.push_back(Piece{{}, std::move(value)});
}

void OutputQueue::drop_front() {
  Piece& p = pieces_.front();
  if (p.shared)
    budget_->unpin(p.shared);
  else
    budget_->release(p.owned.size());
  pieces_.pop_front();
  front_sent_ = 0;
}

bool OutputQueue::flush(int fd, size_t* sent) {
  *sent = 0;
  while (!pieces_.empty()) {
    iovec iov[kMaxIov];
    int n_iov = 0;
    for (auto it = pieces_.begin(); it != pieces_.end() && n_iov < kMaxIov; ++it, ++n_iov) {
      const auto& b = it->bytes();
      const size_t skip = n_iov == 0 ? front_sent_ : 0;
      iov[n_iov] = {const_cast<uint8_t*>(b.data()) + skip, b.size() - skip};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n_iov);
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // POLLOUT later
    if (n <= 0) return false;
    size_t left = static_cast<size_t>(n);
    *sent += left;
    pending_ -= left;
    while (left > 0) {
      const size_t in_front = pieces_.front().bytes().size() - front_sent_;
      if (left < in_front) {
        front_sent_ += left;
        break;
      }
      left -= in_front;
      drop_front();
    }
  }
  return true;
}

void OutputQueue::clear() {
  while (!pieces_.empty()) drop_front();
  pending_ = 0;
}

}  // namespace dtrain::store_detail
