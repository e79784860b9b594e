// libFuzzer harness: what fault tolerance's lighthouse and replicas read
// from the lighthouse's store (src/ft/protocol.h), which any holder of the
// job token could have written. The first byte picks a request, an answer
// or a verdict (its value mod 3); the rest is its text. Text that does not parse is an
// InvalidArgument; text that does must encode back to text that parses to
// the same fields, and an answer's quorum must be readable by each of its
// members (quorum_rule.h). A crash, a sanitizer report, an allocation
// beyond the text's size or another exception is a bug.

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "ft/protocol.h"
#include "ft/quorum_rule.h"

using namespace dtrain::ft;

namespace {

void check_request(const std::string& text) {
  protocol::Request r;
  try {
    r = protocol::parse_request(text);
  } catch (const dtrain::InvalidArgument&) {
    return;
  }
  auto back = protocol::parse_request(protocol::encode(r));
  if (back.replica != r.replica || back.step != r.step || back.world != r.world || back.layout != r.layout ||
      back.rebuild != r.rebuild)
    std::abort();
}

void check_answer(const std::string& text) {
  protocol::Answer a;
  try {
    a = protocol::parse_answer(text);
  } catch (const dtrain::InvalidArgument&) {
    return;
  }
  auto back = protocol::parse_answer(protocol::encode(a));
  if (back.error != a.error || back.quorum_id != a.quorum_id || back.members.size() != a.members.size()) std::abort();
  if (!a.error.empty()) return;
  for (size_t i = 0; i < a.members.size() && i < 8; ++i) {
    auto v = view_of(a, a.members[i].replica, (i & 1) != 0, (i & 2) != 0);
    if (v.replica_rank != static_cast<int>(i) || v.participants < 1 || v.participants > v.replica_world) std::abort();
    if (v.healing() && (v.heal_source < 0 || v.heal_source >= v.replica_world)) std::abort();
  }
}

void check_verdict(const std::string& text) {
  std::vector<protocol::Death> d;
  try {
    d = protocol::parse_deaths(text);
  } catch (const dtrain::InvalidArgument&) {
    return;
  }
  auto back = protocol::parse_deaths(protocol::encode(d));
  if (d.empty() || back.size() != d.size()) std::abort();
  for (size_t i = 0; i < d.size(); ++i)
    if (back[i].replica != d[i].replica || back[i].silent_ms != d[i].silent_ms || back[i].closed != d[i].closed)
      std::abort();
  if (protocol::describe(d).empty()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      check_request(text);
      break;
    case 1:
      check_answer(text);
      break;
    default:
      check_verdict(text);
  }
  return 0;
}
