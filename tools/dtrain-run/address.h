#pragma once

// Addresses the launcher hands to workers and to other nodes.

#include <string>

namespace dtrain::run {

// The local address used to reach `host` (127.0.0.1 for loopback hosts).
std::string address_towards(const std::string& host);

}  // namespace dtrain::run
