// libFuzzer harness: the TCP transport's frame protocol (eager data,
// rendezvous, credit) as a hostile peer speaks it. Each input is the byte
// stream rank 1 sends on its first connection, after a real handshake: rank
// 0 (the real transport, 2 streams, 64 KiB of credit granted each way) has
// posted an eager-sized receive, a rendezvous-sized one, a receive from any
// rank and a send larger than its credit, so every frame kind has somewhere
// to go. The fake then closes; every request must finish (done or failed)
// at once. A crash, a sanitizer report, a request left pending or memory
// allocated beyond the credit (ASan's rss limit) fails the run. Every
// empty message counts against the credit too, and announcements against
// a count of their own, 1,024 here (seeds rts_flood and empty_flood: 2,000
// of each, refused after 1,024 and 256).

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "common/socket.h"
#include "dtrain/errors.h"
#include "dtrain/store/hash_store.h"
#include "transport/tcp/hello.h"
#include "transport/fabric.h"

namespace {

using namespace std::chrono_literals;
namespace tcp = dtrain::transport::tcp;
using dtrain::net::Clock;

// Rank 1's side of the handshake, by hand: one connection per stream.
std::vector<dtrain::net::Fd> fake_rank1(dtrain::Store& store, int streams) {
  const auto id = std::stoull(store.get_string("tcp/id"));
  const auto addr = store.get_string("tcp/addr/0");
  const auto nl = addr.find('\n');
  const auto port = static_cast<uint16_t>(std::stoi(addr.substr(nl + 1)));
  std::vector<dtrain::net::Fd> fds;
  for (int s = 0; s < streams; ++s) {
    auto fd = dtrain::net::connect_to(addr.substr(0, nl), port, Clock::now() + 5s);
    const tcp::Hello hello{tcp::kHelloMagic, tcp::kHelloVersion, id, 1,
                           static_cast<uint32_t>(s), 0, /*eager_kib=*/64, {}};
    dtrain::net::send_all(fd.get(), &hello, sizeof(hello), Clock::now() + 5s, "rank 0");
    tcp::Hello reply{};
    dtrain::net::recv_all(fd.get(), &reply, sizeof(reply), Clock::now() + 5s, "rank 0");
    fds.push_back(std::move(fd));
  }
  return fds;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dtrain::HashStore store(5s);
  dtrain::transport::TcpOptions options;
  options.streams = 2;
  options.timeout = 5s;
  options.name = "fuzz";
  options.unexpected_bytes = 128 << 10;  // 64 KiB per connection
  options.unexpected_messages = 1024;
  std::unique_ptr<dtrain::transport::Transport> t;
  std::thread real([&] {
    namespace tr = dtrain::transport;
    t = tr::connect(store, 0, tr::Topology::host_per_rank(2), tr::FabricOptions{options}).transport;
  });
  auto fds = fake_rank1(store, options.streams);
  real.join();

  std::vector<uint8_t> small(100), large(300000), any(64), out(1 << 20, 7);
  std::vector<dtrain::transport::RequestPtr> requests;
  try {
    requests.push_back(t->irecv(1, 1, small.data(), small.size()));
    requests.push_back(t->irecv(1, 2, large.data(), large.size()));
    requests.push_back(t->irecv_any(3, any.data(), any.size()));
    requests.push_back(t->isend(1, 4, out.data(), out.size()));
  } catch (const std::exception&) {
  }
  // The input on stream 0; stream 1 stays silent. Sending may stop early
  // when rank 0 closed the group over what it read: that is an outcome.
  try {
    dtrain::net::send_all(fds[0].get(), data, size, Clock::now() + 5s, "rank 0");
  } catch (const std::exception&) {
  }
  fds.clear();
  for (auto& r : requests) {
    try {
      r->wait(Clock::now() + 5s, "fuzz");
    } catch (const dtrain::TimeoutError& e) {
      std::fprintf(stderr, "a request stayed pending after the peer closed: %s\n", e.what());
      std::abort();
    } catch (const std::exception&) {
    }
  }
  t.reset();
  return 0;
}
