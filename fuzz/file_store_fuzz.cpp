// libFuzzer harness: the file:// store reading a file it did not write.
// Each input is the whole content of the store's file (records of
// 'S'|'D', u32 key length, u32 value length, key, value); the harness opens
// a FileStore on it and uses it as a rank would: count and check keys, add
// to a counter, read, compare-and-set and delete what is there. A corrupt
// record or a non-integer counter is an exception naming the problem; a
// crash, a sanitizer report or an unbounded allocation is a bug.

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "dtrain/store/file_store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/dev/shm/dtrain-file-store-fuzz-" + std::to_string(getpid());
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    if (size > 0) std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  try {
    dtrain::FileStore store(path, std::chrono::milliseconds(50));
    (void)store.num_keys();
    for (const std::string key : {"a", "n", "", "__dtrain_file_store_users"}) {
      if (!store.check({key})) continue;
      (void)store.get(key);
      try {
        store.add(key, 1);
      } catch (const std::exception&) {  // not an integer: InvalidArgument
      }
      (void)store.compare_set(key, store.get(key), std::vector<uint8_t>{'x'});
      store.delete_key(key);
    }
    store.add("n", 7);
    store.set("a", std::vector<uint8_t>{1, 2, 3});
  } catch (const std::exception&) {
    // A corrupt file is refused with an error; that is the expected outcome.
  }
  ::unlink(path.c_str());
  return 0;
}
