// libFuzzer harness: the snapshot keeper dtrain-run runs per host, on
// requests it did not get from a worker (checkpoint/storage/keepers/keeper.h,
// wire.h). Each input is the byte stream of one connection: the
// keeper reads request after request from it and handles each, as its
// socket would, then the input is read as a keeper's listing. A malformed
// request or listing is an InvalidArgument; a crash, a sanitizer report, a
// payload allocated past the keeper's limit or a hang is a bug.

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "checkpoint/storage/keepers/keeper.h"
#include "dtrain/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace wire = dtrain::snapshot_wire;
  static dtrain::snapshot::Keeper keeper("/tmp", 1 << 16);
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 0;
  size_t sent = 0;
  while (sent < size) {
    const ssize_t n = ::write(fds[0], data + sent, size - sent);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  ::shutdown(fds[0], SHUT_WR);
  try {
    for (int i = 0; i < 64; ++i) {
      // The stream is whole and closed: a read past its end ends at once.
      auto request = wire::read_request(fds[1], 1 << 16);
      (void)keeper.handle(std::move(request));
    }
  } catch (const dtrain::Error&) {  // malformed (InvalidArgument) or the stream's end
  }
  ::close(fds[0]);
  ::close(fds[1]);
  try {
    (void)wire::decode_listing(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const dtrain::InvalidArgument&) {
  }
  return 0;
}
