#include "backends/tcp/backend.h"

#include <thread>

#include "backends/engine/group.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"
#include "store/auth.h"

namespace dtrain::tcp_backend {
namespace {

// DTRAIN_TCP_STREAMS; "auto": a second stream (and I/O thread) pays off only
// where cores are left for it (measured: on 2 cores one stream is faster).
int streams_from_env() {
  if (env::get(env::kTcpStreams).value_or("auto") == "auto")
    return std::thread::hardware_concurrency() > 4 ? 2 : 1;
  return static_cast<int>(*env::get_int(env::kTcpStreams, 1, 16));
}

}  // namespace

transport::TcpOptions tcp_options(const GroupOptions& options) {
  transport::TcpOptions t;
  t.local_address = options.local_address();
  t.streams = streams_from_env();
  t.timeout = options.timeout();
  t.name = options.name();
  t.token = store_auth::token_from_environment().value_or("");
  t.unexpected_bytes =
      static_cast<size_t>(*env::get_int(env::kTcpUnexpectedBytes, 65536, int64_t{1} << 50));
  return t;
}

namespace {

std::unique_ptr<transport::Transport> connect_tcp(Store& store, int rank, int size,
                                                  const GroupOptions& options) {
  auto transport = transport::connect_tcp(store, rank, size, tcp_options(options));
  DTRAIN_LOG_INFO("tcp: group '", options.name(), "' connected, rank ", rank, "/", size, " via ",
                  options.local_address().empty() ? "127.0.0.1" : options.local_address());
  return transport;
}

}  // namespace

std::shared_ptr<ProcessGroup> create_tcp_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options) {
  return std::make_shared<engine_backend::EngineProcessGroup>(
      std::move(store), rank, size, options,
      engine_backend::EngineProcessGroup::Carrier{connect_tcp, "tcp", nullptr});
}

// "gloo" is PyTorch's name for its CPU backend: code written for
// torch.distributed gets dtrain's tcp backend under it.
DTRAIN_REGISTER_BACKEND(tcp, {
  register_backend("tcp", create_tcp_group);
  register_backend("gloo", create_tcp_group);
})

}  // namespace dtrain::tcp_backend
