#include "store/tcp_store_client.h"

#include <algorithm>

#include "common/enforce.h"
#include "store/auth.h"
#include "store/store_util.h"

namespace dtrain {

using namespace store_detail;
using Clock = net::Clock;

namespace {

// Timeouts travel as u32 milliseconds and are added to clock readings;
// clamp absurd ones (say, milliseconds::max() meaning "forever") to 24 days.
std::chrono::milliseconds clamp(std::chrono::milliseconds t) {
  return std::clamp(t, std::chrono::milliseconds(0), std::chrono::milliseconds(INT32_MAX));
}

std::string quoted_op(const char* op, const std::string& key) {
  return detail::cat(op, " of key ", quote(key));
}

}  // namespace

TcpStoreClient::TcpStoreClient(std::string host, uint16_t port, ms timeout,
                               std::optional<std::string> token)
    : host_(std::move(host)), port_(port), where_(net::endpoint(host_, port_)),
      token_(std::move(token)) {
  std::lock_guard<std::mutex> lock(mutex_);
  connect(timeout);
}

// Connects and makes its first request at once: the job token's proof, or
// without a token a NUM_KEYS. (The server closes connections that stay
// silent for 10 s, and a client may sit idle longer than that between its
// construction and its first call.)
void TcpStoreClient::connect(ms timeout) {
  const auto deadline = Clock::now() + clamp(timeout);
  try {
    fd_ = net::connect_to(host_, port_, deadline);
    if (token_) {
      prove_token(deadline);
      return;
    }
    std::vector<uint8_t> body;
    const auto h = exchange(wire::Writer(wire::kNumKeys, 0).finish(), &body, deadline);
    if (h.opcode != wire::kOk || body.size() != 8)
      throw NetworkError(detail::cat(where_, " answered the connection check with a frame that "
                                     "is not a dtrain store reply"));
  } catch (const InvalidArgument&) {
    fd_.reset();
    throw;
  } catch (const TimeoutError& e) {
    fd_.reset();
    throw TimeoutError(detail::cat("TCP store: ", e.what()));
  } catch (const NetworkError& e) {
    // The server says why it closes a connection (a REFUSED frame: no job
    // token proved, its connection limit); a bare close is not blamed on
    // the token.
    fd_.reset();
    const std::string why = e.what();
    throw NetworkError(detail::cat(
        "TCP store: ", why,
        why.find("connection closed by") == std::string::npos &&
                why.find("reset by peer") == std::string::npos
            ? ""
            : " before answering the connection's first request (the store may be shutting "
              "down, or it closed this connection among too many that had made no request)"));
  }
}

// A REFUSED frame: the server closes this connection and says why.
void TcpStoreClient::refused(const wire::Header& h, net::Clock::time_point deadline) {
  std::vector<uint8_t> body(std::min<uint32_t>(h.length, 4096));
  std::string why = "(no reason given)";
  try {
    net::recv_all(fd_.get(), body.data(), body.size(), deadline, where_);
    wire::Reader r(body.data(), body.size());
    why = r.str();
  } catch (const std::exception&) {
  }
  throw NetworkError(detail::cat(where_, " closed the connection: ", why));
}

wire::Header TcpStoreClient::exchange(const std::vector<uint8_t>& request,
                                      std::vector<uint8_t>* body, net::Clock::time_point deadline) {
  std::vector<uint8_t> frame = request;
  const uint32_t id = next_request_id_++;
  for (int i = 0; i < 4; ++i) frame[12 + i] = static_cast<uint8_t>(id >> (8 * i));
  net::send_all(fd_.get(), frame.data(), frame.size(), deadline, where_);
  uint8_t head[wire::kHeaderBytes];
  net::recv_all(fd_.get(), head, sizeof(head), deadline, where_);
  const wire::Header h = wire::decode_header(head);
  if (!wire::header_problem(h, /*is_request=*/false) && h.opcode == wire::kRefused)
    refused(h, deadline);
  if (wire::header_problem(h, /*is_request=*/false) || h.request_id != id || h.length > 4096)
    throw NetworkError(detail::cat(where_, " answered with a frame that is not a dtrain store reply"));
  body->resize(h.length);
  net::recv_all(fd_.get(), body->data(), body->size(), deadline, where_);
  return h;
}

// AUTH_HELLO and AUTH_PROOF (store/auth.h). The server proves the token
// first, so a client never sends its proof to a server without it.
void TcpStoreClient::prove_token(net::Clock::time_point deadline) {
  namespace auth = store_auth;
  const auth::Nonce mine = auth::random_nonce();
  std::vector<uint8_t> body;
  auto h = exchange(wire::Writer(wire::kAuthHello, 0).bytes(mine.data(), mine.size()).finish(),
                    &body, deadline);
  wire::Reader r(body.data(), body.size());
  if (h.opcode == wire::kError)
    throw InvalidArgument(detail::cat("TCP store ", where_, ": a job token is set here but ",
                                      r.str()));
  auth::Nonce theirs{};
  try {
    const auto nonce = r.bytes();
    const auto proof = r.bytes();
    r.expect_end();
    if (h.opcode != wire::kOk || nonce.size() != theirs.size()) throw wire::Malformed{"bad nonce"};
    std::copy(nonce.begin(), nonce.end(), theirs.begin());
    if (!auth::matches(auth::proof(*token_, 'S', mine, theirs), proof.data(), proof.size()))
      throw NetworkError(detail::cat(where_, " does not hold this job's token (is "
                                     "DTRAIN_STORE_TOKEN the same on every node?)"));
  } catch (const wire::Malformed&) {
    throw NetworkError(detail::cat(where_, " answered AUTH_HELLO with a malformed reply"));
  }
  const auto answer = auth::proof(*token_, 'C', theirs, mine);
  try {
    h = exchange(wire::Writer(wire::kAuthProof, 0).bytes(answer.data(), answer.size()).finish(),
                 &body, deadline);
  } catch (const NetworkError& e) {
    if (std::string(e.what()).find("closed the connection: ") != std::string::npos) throw;
    throw NetworkError(detail::cat(where_, " closed the connection before answering this job "
                                   "token's proof"));
  }
  if (h.opcode != wire::kOk)
    throw NetworkError(detail::cat(where_, " refused this job token"));
}

uint16_t TcpStoreClient::call(std::vector<uint8_t> frame, ms timeout, bool blocking,
                              const std::string& what,
                              const std::function<void(wire::Reader&)>& parse) {
  const size_t payload = frame.size() - wire::kHeaderBytes;
  DTRAIN_CHECK_ARG(payload <= TcpStore::kMaxFrameBytes, "TCP store ", where_, ": ", what,
                   ": request of ", payload, " bytes is over the frame limit of ",
                   TcpStore::kMaxFrameBytes, " bytes");
  timeout = clamp(timeout);
  std::lock_guard<std::mutex> lock(mutex_);
  const uint32_t id = next_request_id_++;
  for (int i = 0; i < 4; ++i) frame[12 + i] = static_cast<uint8_t>(id >> (8 * i));
  if (!fd_) connect(timeout);

  const auto start = Clock::now();
  const auto reply_budget = timeout + (blocking ? kReplyGrace : ms(0));
  wire::Header h;
  std::vector<uint8_t> body;
  try {
    net::send_all(fd_.get(), frame.data(), frame.size(), start + timeout, where_);
    uint8_t head[wire::kHeaderBytes];
    net::recv_all(fd_.get(), head, sizeof(head), start + reply_budget, where_);
    h = wire::decode_header(head);
    if (const char* problem = wire::header_problem(h, /*is_request=*/false))
      throw NetworkError(detail::cat("bad reply header: ", problem));
    if (h.opcode == wire::kRefused) refused(h, start + reply_budget);
    if (h.request_id != id)
      throw NetworkError(detail::cat("reply to request ", h.request_id, " while waiting for ", id));
    body.resize(h.length);
    net::recv_all(fd_.get(), body.data(), body.size(), start + reply_budget, where_);
  } catch (const TimeoutError&) {
    // The reply may still come; closing the socket makes sure nobody reads
    // it as the answer to a later request.
    fd_.reset();
    throw TimeoutError(detail::cat("TCP store ", where_, ": no reply to ", what, " within ",
                                   reply_budget.count(), " ms (server stopped or unreachable)"));
  } catch (const NetworkError& e) {
    fd_.reset();
    throw NetworkError(detail::cat("TCP store ", where_, ": ", what, " failed: ", e.what()));
  }

  try {
    wire::Reader r(body.data(), body.size());
    if (h.opcode == wire::kError)
      throw InvalidArgument(detail::cat("TCP store ", where_, ": ", what, ": ", r.str()));
    if (h.opcode == wire::kOk) parse(r);
    r.expect_end();
  } catch (const wire::Malformed& m) {
    fd_.reset();
    throw NetworkError(detail::cat("TCP store ", where_, ": malformed reply to ", what, ": ",
                                   m.what));
  }
  return h.opcode;
}

namespace {

void check_key(const std::string& where, const std::string& key) {
  DTRAIN_CHECK_ARG(key.size() <= wire::kMaxKeyBytes, "TCP store ", where, ": key of ",
                   key.size(), " bytes is over the limit of ", wire::kMaxKeyBytes, " bytes");
}

const auto kNoReply = [](wire::Reader&) {};

}  // namespace

void TcpStoreClient::set(const std::string& key, const std::vector<uint8_t>& value,
                         ms timeout) {
  check_key(where_, key);
  call(wire::Writer(wire::kSet, 0).str(key).bytes(value).finish(), timeout, false,
       quoted_op("SET", key), kNoReply);
}

void TcpStoreClient::set_ephemeral(const std::string& key, const std::vector<uint8_t>& value, ms timeout) {
  check_key(where_, key);
  call(wire::Writer(wire::kSetEphemeral, 0).str(key).bytes(value).finish(), timeout, false,
       quoted_op("SET_EPHEMERAL", key), kNoReply);
}

std::vector<uint8_t> TcpStoreClient::get(const std::string& key, ms timeout) {
  check_key(where_, key);
  timeout = clamp(timeout);
  std::vector<uint8_t> value;
  const uint16_t status =
      call(wire::Writer(wire::kGet, 0).str(key).u32(uint32_t(timeout.count())).finish(),
           timeout, true, quoted_op("GET", key), [&](wire::Reader& r) { value = r.bytes(); });
  if (status == wire::kTimeout)
    throw TimeoutError(timeout_message("TCP store " + where_, timeout, {key}));
  return value;
}

int64_t TcpStoreClient::add(const std::string& key, int64_t delta, ms timeout) {
  check_key(where_, key);
  int64_t sum = 0;
  call(wire::Writer(wire::kAdd, 0).str(key).i64(delta).finish(), timeout, false,
       quoted_op("ADD", key), [&](wire::Reader& r) { sum = r.i64(); });
  return sum;
}

std::vector<uint8_t> TcpStoreClient::compare_set(const std::string& key,
                                                 const std::vector<uint8_t>& expected,
                                                 const std::vector<uint8_t>& desired,
                                                 ms timeout) {
  check_key(where_, key);
  std::vector<uint8_t> now;
  call(wire::Writer(wire::kCompareSet, 0).str(key).bytes(expected).bytes(desired).finish(),
       timeout, false, quoted_op("COMPARE_SET", key), [&](wire::Reader& r) { now = r.bytes(); });
  return now;
}

bool TcpStoreClient::check(const std::vector<std::string>& keys, ms timeout) {
  wire::Writer w(wire::kCheck, 0);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) {
    check_key(where_, k);
    w.str(k);
  }
  uint32_t all = 0;
  call(w.finish(), timeout, false, "CHECK of keys " + quote_all(keys),
       [&](wire::Reader& r) { all = r.u32(); });
  return all != 0;
}

bool TcpStoreClient::delete_key(const std::string& key, ms timeout) {
  check_key(where_, key);
  uint32_t existed = 0;
  call(wire::Writer(wire::kDelete, 0).str(key).finish(), timeout, false,
       quoted_op("DELETE", key), [&](wire::Reader& r) { existed = r.u32(); });
  return existed != 0;
}

int64_t TcpStoreClient::num_keys(ms timeout) {
  int64_t n = 0;
  call(wire::Writer(wire::kNumKeys, 0).finish(), timeout, false, "NUM_KEYS",
       [&](wire::Reader& r) { n = r.i64(); });
  return n;
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, ms timeout) {
  timeout = clamp(timeout);
  wire::Writer w(wire::kWait, 0);
  w.u32(uint32_t(timeout.count())).u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) {
    check_key(where_, k);
    w.str(k);
  }
  const uint16_t status =
      call(w.finish(), timeout, true, "WAIT for keys " + quote_all(keys), kNoReply);
  if (status != wire::kTimeout) return;
  // The reply does not say which keys were missing; ask, so the message
  // names only those (best effort: the server may be gone by now).
  std::vector<std::string> missing;
  try {
    for (const auto& k : keys)
      if (!check({k}, timeout)) missing.push_back(k);
  } catch (const Error&) {
  }
  throw TimeoutError(timeout_message("TCP store " + where_, timeout, missing.empty() ? keys : missing));
}

}  // namespace dtrain
