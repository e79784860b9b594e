// dtrain-trace analyze DIR: reads the flight recorder dumps in DIR
// (DTRAIN_TRACE_DIR of a job) — with what dumps left unfinished and the
// failed ranks' error files (error-R.json, from dtrain-run) hold — and
// prints which rank called a different collective, never arrived, or is
// behind, then every observation.
// Exit status: 0 the ranks agree, 1 a rank is at fault, 2 bad usage or
// unreadable dumps.

#include <cstdio>
#include <string>

#include "analyze.h"

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != "analyze") {
    std::fprintf(stderr, "usage: dtrain-trace analyze DIR  (DIR: a job's DTRAIN_TRACE_DIR)\n");
    return 2;
  }
  try {
    const auto evidence = dtrain::trace::load_evidence(argv[2]);
    if (evidence.dumps.empty()) {
      std::fprintf(stderr, "dtrain-trace: no flight recorder dumps (rank-*.json) in %s\n", argv[2]);
      for (const auto& problem : evidence.unusable) std::fprintf(stderr, "  %s\n", problem.c_str());
      return 2;
    }
    const auto report = dtrain::trace::analyze(evidence);
    std::printf("%s\n", report.verdict.c_str());
    for (const auto& line : report.findings) std::printf("  %s\n", line.c_str());
    return report.verdict == "verdict: the ranks agree and none is behind" ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-trace: %s\n", e.what());
    return 2;
  }
}
