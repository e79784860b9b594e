// FileStore never waits for ever on its file's flock: another process that
// holds the lock and stops (SIGSTOP, as a stopped rank would) turns every
// operation into a TimeoutError naming the file, and closing the store gives
// up instead of hanging the program's exit.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <future>
#include <memory>
#include <string>

#include "dtrain/errors.h"
#include "dtrain/store/file_store.h"
#include "harness/assertions.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::Contains;

std::string temp_path() {
  char dir[] = "/tmp/dtrain-lock-XXXXXX";
  EXPECT_NE(::mkdtemp(dir), nullptr);
  return std::string(dir) + "/store";
}

// A child process that takes the file's exclusive flock and stops itself
// while holding it. Killing it (release(), or the destructor) frees the lock.
class StoppedLockHolder {
 public:
  explicit StoppedLockHolder(const std::string& path) {
    int ready[2];
    EXPECT_EQ(::pipe(ready), 0);
    pid_ = ::fork();
    if (pid_ == 0) {  // only async-signal-safe calls from here on
      const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
      if (fd < 0 || ::flock(fd, LOCK_EX) != 0) ::_exit(1);
      const char c = 1;
      if (::write(ready[1], &c, 1) != 1) ::_exit(1);
      ::raise(SIGSTOP);
      for (;;) ::pause();
    }
    ::close(ready[1]);
    char c = 0;
    EXPECT_EQ(::read(ready[0], &c, 1), 1) << "the child could not lock " << path;
    ::close(ready[0]);
    int status = 0;
    EXPECT_EQ(::waitpid(pid_, &status, WUNTRACED), pid_);
    EXPECT_TRUE(WIFSTOPPED(status)) << "the child did not stop";
  }
  ~StoppedLockHolder() { release(); }
  void release() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
};

struct Outcome {
  bool returned = false;  // false: still blocked after the limit
  std::string timeout_error;  // what a TimeoutError said, if one was thrown
  double seconds = 0;
};

// Runs fn on another thread. A call still blocked after `limit` fails the
// test; the holder is then killed so that the call (and the test) can end.
Outcome run_bounded(StoppedLockHolder& holder, const std::function<void()>& fn,
                    std::chrono::seconds limit = 10s) {
  auto outcome = std::make_shared<Outcome>();
  const auto start = Clock::now();
  auto done = std::async(std::launch::async, [fn, outcome, start] {
    try {
      fn();
    } catch (const TimeoutError& e) {
      outcome->timeout_error = e.what();
    }
    outcome->seconds = testing::seconds_since(start);
  });
  outcome->returned = done.wait_for(limit) == std::future_status::ready;
  if (!outcome->returned) {
    ADD_FAILURE() << "still blocked on the lock after " << limit.count() << " s";
    holder.release();
  }
  done.get();
  return *outcome;
}

TEST(FileStoreLock, OperationsTimeOutNamingTheFileWhenAStoppedProcessHoldsItsLock) {
  const auto path = temp_path();
  auto store = std::make_unique<FileStore>(path, 500ms);
  store->set("key", std::string("value"));
  StoppedLockHolder holder(path);
  const std::string expected = "FileStore '" + path +
                               "': timed out after 500 ms waiting to lock the file: another "
                               "process holds its lock (is a rank stopped or stuck?)";
  const std::vector<std::pair<std::string, std::function<void()>>> calls = {
      {"set", [&] { store->set("other", std::string("x")); }},
      {"get", [&] { store->get("key"); }},
      {"add", [&] { store->add("counter", 1); }},
      {"check", [&] { store->check({"key"}); }},
      {"a second FileStore", [&] { FileStore(path, 500ms); }},
  };
  for (const auto& [name, call] : calls) {
    const auto outcome = run_bounded(holder, call);
    EXPECT_EQ(outcome.timeout_error, expected) << name;
    EXPECT_GE(outcome.seconds, 0.4) << name;
    EXPECT_LT(outcome.seconds, 3.0) << name;
  }
  // wait() with its own timeout waits for the lock no longer than that.
  const auto waited = run_bounded(holder, [&] { store->wait({"key"}, 200ms); });
  EXPECT_TRUE(Contains(waited.timeout_error, "timed out after 200 ms waiting to lock the file"));
  EXPECT_LT(waited.seconds, 2.0);

  holder.release();  // the store works again once the lock is free
  EXPECT_EQ(store->get_string("key"), "value");
  store.reset();
  struct stat st {};
  EXPECT_NE(::stat(path.c_str(), &st), 0) << "the last user did not remove the file";
  ::rmdir(path.substr(0, path.rfind('/')).c_str());
}

TEST(FileStoreLock, ClosingGivesUpWhileAStoppedProcessHoldsTheLock) {
  const auto path = temp_path();
  auto store = std::make_unique<FileStore>(path, 500ms);
  StoppedLockHolder holder(path);
  ::testing::internal::CaptureStderr();
  const auto outcome = run_bounded(holder, [&] { store.reset(); });
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_LT(outcome.seconds, 3.0);
  EXPECT_TRUE(Contains(log, "[dtrain] warning: FileStore '" + path +
                                "': timed out after 500 ms waiting to lock the file"));
  EXPECT_TRUE(Contains(log, "closing without updating the file, which stays behind"));
  holder.release();
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << "the file should stay: its user count was not updated";
  ::unlink(path.c_str());
  ::rmdir(path.substr(0, path.rfind('/')).c_str());
}

}  // namespace
}  // namespace dtrain
