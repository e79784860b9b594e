#include "ft/state_fingerprint.h"

#include <cstdio>
#include <sstream>

namespace dtrain::ft {

std::string state_fingerprint(const checkpoint::DistributedState& state) {
  std::ostringstream text;
  for (const auto& [name, t] : state.replicated) text << "r " << name << " " << t.scalar_type() << " " << t.sizes() << "\n";
  for (const auto& [name, s] : state.sharded) {
    text << "s " << name << " " << s.local.scalar_type() << " " << s.local.sizes() << " " << s.numel << " " << s.offset;
    for (auto d : s.shape) text << " s" << d;
    for (auto o : s.offsets) text << " o" << o;
    text << "\n";
  }
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : text.str()) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
  return hex;
}

}  // namespace dtrain::ft
