// Preloaded into dtrain-run by a launcher test: starts a thread before
// main(), as a library does when it is loaded (OpenBLAS starts its thread
// pool from a constructor). That thread keeps the default signal mask, so a
// process-directed SIGTERM may land in it whatever main() blocks.
#include <pthread.h>
#include <unistd.h>

namespace {

void* idle(void*) {
  for (;;) pause();
}

}  // namespace

__attribute__((constructor)) static void start_early_thread() {
  pthread_t thread;
  if (pthread_create(&thread, nullptr, idle, nullptr) == 0) pthread_detach(thread);
}
