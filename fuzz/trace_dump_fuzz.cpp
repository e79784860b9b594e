// dtrain-trace's dump reader and analyzer on arbitrary bytes: a dump is a
// file anyone may have written. The input is read as one rank's dump, and a
// copy of it as the next rank's, so the analyzer compares two ranks.

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "analyze.h"
#include "dumps.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    auto dump = dtrain::trace::parse_dump(text, "input");
    std::map<int, dtrain::trace::Dump> dumps;
    dumps[dump.rank] = dump;
    if (dump.world_size < 0 || dump.rank + 1 < dump.world_size) {
      dump.rank += 1;
      dumps[dump.rank] = dump;
    }
    dtrain::trace::analyze(dumps);
  } catch (const dtrain::trace::BadDump&) {
  }
  return 0;
}
