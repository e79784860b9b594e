#pragma once

// Shared by rank_worker's source files (rank_worker.cpp says what each
// mode does).

#include <iostream>
#include <string>

#include "dtrain/distributed.h"

inline int fail(const std::string& what) {
  std::cout << "FAILED rank " << dtrain::get_rank() << ": " << what << std::endl;
  return 1;
}

int fsdp_equivalence(const std::string& backend, bool sharded_construction);
int zero_equivalence(const std::string& backend, int stage);  // ZeRO-1 or ZeRO-2
