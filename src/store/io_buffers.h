#pragma once

// The TCP store server's connection buffers and the one budget that bounds
// them all (docs/security.md, "What a hostile client cannot do").
//
// Every byte the server holds for a connection, rather than in its map, is
// charged to one IoBudget: the input buffers (a request that has not fully
// arrived) and the unsent replies. A stored value that replies send is not
// copied into them: each reply holds a reference to it (SharedBytes), and
// the budget charges a value once, when the first unsent reply takes it,
// however many replies share it. So 4,096 clients that GET one 32 MiB value
// and never read cost the 32 MiB the map holds anyway, not 4,096 copies.
//
// The server asks the budget before it grows an input buffer (try_charge);
// when it is spent it stops reading and handling requests rather than
// allocate, and goes on as replies drain or requests complete. Replies are
// charged as they are built (charge): a connection's replies are only built
// while the budget is not spent, so it is passed by one reply at most.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

namespace dtrain::store_detail {

using SharedBytes = std::shared_ptr<const std::vector<uint8_t>>;

class IoBudget {
 public:
  explicit IoBudget(size_t limit) : limit_(limit) {}
  IoBudget(const IoBudget&) = delete;
  IoBudget& operator=(const IoBudget&) = delete;

  size_t limit() const { return limit_; }
  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  bool spent() const { return used_ >= limit_; }
  // Charges n bytes if that stays within the limit.
  bool try_charge(size_t n);
  // Charges n bytes whatever the total (a reply already decided on).
  void charge(size_t n);
  void release(size_t n);
  // A stored value taken by an unsent reply: charged on its first
  // reference, released with its last.
  void pin(const SharedBytes& v);
  void unpin(const SharedBytes& v);

 private:
  size_t limit_;
  size_t used_ = 0;
  size_t peak_ = 0;
  std::unordered_map<const void*, size_t> pins_;  // value -> unsent replies holding it
};

// A connection's bytes received and not yet handled: one request at most,
// plus whatever followed it in the same read. Its capacity is charged to
// the budget; it is freed when empty and shrunk when mostly unused, so an
// idle connection holds nothing.
class InputBuffer {
 public:
  explicit InputBuffer(IoBudget* budget) : budget_(budget) {}
  InputBuffer(InputBuffer&& o) noexcept;
  InputBuffer& operator=(InputBuffer&&) = delete;
  ~InputBuffer() { free(); }

  const uint8_t* data() const { return buf_.get() + begin_; }
  size_t size() const { return end_ - begin_; }
  bool empty() const { return size() == 0; }
  size_t capacity() const { return cap_; }
  // Makes room for `total` bytes in all (size() included), charging the
  // growth; false when the budget cannot cover it (nothing changes). The
  // buffer at least doubles as it grows (up to `most`), so a request that
  // arrives field by field is copied O(1) times on average.
  bool reserve(size_t total, size_t most);
  // Appends bytes already received, charging what the buffer must grow.
  void append(const uint8_t* p, size_t n);
  // Where the next bytes go (room() of them, at least what reserve() made
  // room for), and how many came.
  uint8_t* tail() { return buf_.get() + end_; }
  size_t room() const { return cap_ - end_; }
  void grew(size_t n) { end_ += n; }
  // Drops the first n bytes (handled requests); the memory goes back when
  // nothing is left, or when much less is left than the buffer holds.
  void consume(size_t n);

 private:
  void free();
  void resize_to(size_t cap);
  IoBudget* budget_;
  std::unique_ptr<uint8_t[]> buf_;
  size_t cap_ = 0, begin_ = 0, end_ = 0;
};

// A connection's unsent replies, in order: bytes of its own (headers,
// small replies) and references to stored values, sent without copying.
class OutputQueue {
 public:
  explicit OutputQueue(IoBudget* budget) : budget_(budget) {}
  OutputQueue(OutputQueue&& o) noexcept;
  OutputQueue& operator=(OutputQueue&&) = delete;
  ~OutputQueue() { clear(); }

  void append(std::vector<uint8_t> bytes);
  void append(SharedBytes value);
  size_t pending() const { return pending_; }
  // Sends as much as the socket takes now. Returns false when the socket
  // failed (the peer is gone); *sent counts the bytes sent.
  bool flush(int fd, size_t* sent);
  void clear();

 private:
  struct Piece {
    std::vector<uint8_t> owned;
    SharedBytes shared;
    const std::vector<uint8_t>& bytes() const { return shared ? *shared : owned; }
  };
  void drop_front();
  IoBudget* budget_;
  std::deque<Piece> pieces_;
  size_t front_sent_ = 0;  // bytes of pieces_.front() already sent
  size_t pending_ = 0;
};

}  // namespace dtrain::store_detail
