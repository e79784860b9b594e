#include "ft/lighthouse_link.h"

#include <algorithm>

#include "common/enforce.h"
#include "common/logging.h"
#include "common/socket.h"
#include "store/auth.h"
#include "store/tcp_store_client.h"

namespace dtrain::ft {

std::string LighthouseAddress::text() const { return net::endpoint(host, port); }

LighthouseAddress parse_lighthouse_address(const std::string& text, const std::string& what) {
  const size_t colon = text.rfind(':');
  DTRAIN_CHECK_ARG(colon != std::string::npos && colon > 0, what, ": '", text, "' is not host:port");
  std::string host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  DTRAIN_CHECK_ARG(!host.empty(), what, ": '", text, "' has no host");
  return LighthouseAddress{host, net::parse_port(text.substr(colon + 1), what)};
}

LighthouseLink::LighthouseLink(LighthouseAddress address, std::string token, std::chrono::milliseconds timeout)
    : address_(std::move(address)), token_(std::move(token)), timeout_(timeout) {}

std::shared_ptr<TcpStore> LighthouseLink::store(std::chrono::milliseconds connect_timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (store_) return store_;
  std::shared_ptr<TcpStore> s;
  bool lighthouse = false;
  try {
    s = std::make_shared<TcpStore>(TcpStoreOptions()
                                       .host(address_.host)
                                       .port(address_.port)
                                       .timeout(connect_timeout)
                                       .token(token_));
    lighthouse = s->check({protocol::kIncarnationKey});
  } catch (const NetworkError& e) {
    throw NetworkError(detail::cat("the lighthouse at ", address_.text(), " is unreachable or refused this replica: ",
                                   e.what()));
  } catch (const TimeoutError& e) {
    throw TimeoutError(detail::cat("the lighthouse at ", address_.text(), " is unreachable or refused this replica: ",
                                   e.what()));
  } catch (const InvalidArgument& e) {  // the job token: set here and not there, or unreadable
    throw InvalidArgument(detail::cat("the lighthouse at ", address_.text(), ": ", e.what()));
  }
  DTRAIN_CHECK_ARG(lighthouse, "the store at ", address_.text(), " is not a dtrain lighthouse (it has no '",
                   protocol::kIncarnationKey, "' key)");
  s->set_timeout(timeout_);
  store_ = s;
  return s;
}

void LighthouseLink::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  store_.reset();
}

protocol::Answer LighthouseLink::ask(const protocol::Request& request, std::chrono::milliseconds connect_timeout,
                                     std::chrono::milliseconds quorum_timeout) {
  auto s = store(connect_timeout);
  const int64_t n = s->add(protocol::kRequestsKey, 1);
  s->set(protocol::request_key(n), protocol::encode(request));
  const std::string key = protocol::answer_key(n);
  try {
    s->wait({key}, quorum_timeout);
  } catch (const TimeoutError&) {
    throw TimeoutError(detail::cat("no quorum from the lighthouse at ", address_.text(), " within ",
                                   quorum_timeout.count(), " ms"));
  }
  const std::string text = s->get_string(key);
  s->delete_key(key);
  return protocol::parse_answer(text);
}

Heartbeat::Heartbeat(LighthouseAddress address, std::string token, std::string replica,
                     std::chrono::milliseconds interval)
    : address_(std::move(address)),
      token_(token.empty() ? store_auth::token_from_environment() : std::optional<std::string>(token)),
      replica_(replica),
      key_(protocol::heartbeat_key(replica)),
      interval_(interval),
      thread_([this] { run(); }) {}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Heartbeat::beat() {
  const auto timeout = std::max(interval_ * 10, std::chrono::milliseconds(1000));
  if (!client_) {
    auto client = std::make_unique<TcpStoreClient>(address_.host, address_.port, timeout, token_);
    if (!client->check({protocol::kIncarnationKey}, timeout)) return;  // not a lighthouse: the requests say so
    client->set_ephemeral(protocol::present_key(replica_), std::vector<uint8_t>(replica_.begin(), replica_.end()),
                          timeout);
    client_ = std::move(client);
    registered_ = false;
  }
  client_->add(key_, 1, timeout);
  if (!registered_) {
    const int64_t n = client_->add(protocol::kRegistrationsKey, 1, timeout);
    client_->set(protocol::registration_key(n), std::vector<uint8_t>(replica_.begin(), replica_.end()), timeout);
    registered_ = true;
  }
}

void Heartbeat::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    try {
      beat();
    } catch (const std::exception&) {
      client_.reset();  // the lighthouse is away: the quorum requests say so; beat again later
    }
    lock.lock();
    wake_.wait_for(lock, interval_, [this] { return stop_; });
  }
}

DeathWatch::DeathWatch(LighthouseAddress address, std::string token, std::chrono::milliseconds interval,
                       OnDeaths on_deaths)
    : link_(std::move(address), std::move(token), std::max(interval * 10, std::chrono::milliseconds(1000))),
      interval_(interval),
      on_deaths_(std::move(on_deaths)),
      thread_([this] { run(); }) {}

DeathWatch::~DeathWatch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void DeathWatch::watch(const std::string& quorum_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  quorum_ = quorum_id;
}

void DeathWatch::look(const std::string& quorum_id) {
  std::vector<protocol::Death> deaths;
  try {
    auto store = link_.store(std::max(interval_ * 10, std::chrono::milliseconds(1000)));
    const std::string key = protocol::dead_key(quorum_id);
    if (!store->check({key})) return;
    deaths = protocol::parse_deaths(store->get_string(key));
  } catch (const InvalidArgument& e) {
    log_warning(detail::cat("dtrain ft: the lighthouse's verdict on quorum ", quorum_id, " is ignored: ", e.what()));
  } catch (const std::exception&) {
    link_.reset();  // the lighthouse is away: look again later
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (quorum_ != quorum_id) return;
    quorum_.clear();  // one verdict per quorum
  }
  if (!deaths.empty()) on_deaths_(quorum_id, deaths);
}

void DeathWatch::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    const std::string quorum = quorum_;
    lock.unlock();
    if (!quorum.empty()) look(quorum);
    lock.lock();
    wake_.wait_for(lock, interval_, [this] { return stop_; });
  }
}

}  // namespace dtrain::ft
