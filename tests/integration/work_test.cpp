// The Work contract's callbacks: on_success that throws fails the work on
// both paths (registered before the work finished, or after it succeeded),
// and wait() returns only once the on_finish callbacks have run (the flight
// recorder's failure dump is one), on a work finished by another thread.

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "dtrain/errors.h"
#include "dtrain/work.h"
#include "harness/assertions.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::Contains;
using testing::what_thrown;

void throw_copy_failed() { throw InvalidArgument("copying the result back failed"); }

TEST(WorkCallbacks, OnSuccessThatThrowsBeforeTheWorkFinishesFailsIt) {
  auto work = std::make_shared<Work>("all_reduce #0");
  work->on_success(throw_copy_failed);
  bool later_ran = false;
  work->on_success([&] { later_ran = true; });
  work->finish();
  EXPECT_TRUE(work->is_completed());
  EXPECT_FALSE(work->is_success());
  EXPECT_FALSE(later_ran) << "a callback after the failing one ran";
  EXPECT_NE(work->exception(), nullptr);
  EXPECT_TRUE(Contains(what_thrown<InvalidArgument>([&] { work->wait(); }),
                       "copying the result back failed"));
}

TEST(WorkCallbacks, OnSuccessThatThrowsOnAFinishedWorkFailsItAndDoesNotEscape) {
  auto work = Work::completed("all_reduce #1");
  ASSERT_TRUE(work->is_success());
  EXPECT_NO_THROW(work->on_success(throw_copy_failed))
      << "the callback's exception escaped to the caller of on_success";
  EXPECT_TRUE(work->is_completed());
  EXPECT_FALSE(work->is_success()) << "the work still reports success";
  ASSERT_NE(work->exception(), nullptr);
  EXPECT_TRUE(Contains(what_thrown<InvalidArgument>([&] { work->wait(); }),
                       "copying the result back failed"));
  // Failed now: a later callback does not run.
  bool ran = false;
  work->on_success([&] { ran = true; });
  EXPECT_FALSE(ran);
}

TEST(WorkCallbacks, OnSuccessOnAFailedWorkNeverRuns) {
  auto work = std::make_shared<Work>("barrier #2");
  work->finish(std::make_exception_ptr(TimeoutError("barrier #2 timed out")));
  bool ran = false;
  work->on_success([&] { ran = true; });
  EXPECT_FALSE(ran);
  EXPECT_TRUE(Contains(what_thrown<TimeoutError>([&] { work->wait(); }), "barrier #2 timed out"));
}

// A failure finished by another thread (as a backend's executor does): the
// waiter's wait() rethrows only after the on_finish callbacks are done, so
// a program that lets the error end it cannot cut them short.
TEST(WorkCallbacks, WaitRethrowsOnlyAfterTheOnFinishCallbacksHaveRun) {
  auto work = std::make_shared<Work>("all_reduce #4");
  work->set_source_rank(2);
  std::atomic<bool> callback_done{false};
  int source_in_callback = -1;
  bool completed_in_callback = true;
  work->on_finish([&](const std::exception_ptr& error) {
    completed_in_callback = work->is_completed();
    if (!error) source_in_callback = work->source_rank();
    std::this_thread::sleep_for(300ms);  // a dump being written and synced
    callback_done = true;
  });
  std::thread finisher([&] { work->finish(std::make_exception_ptr(TimeoutError("timed out"))); });
  EXPECT_TRUE(Contains(what_thrown<TimeoutError>([&] { work->wait(); }), "timed out"));
  EXPECT_TRUE(callback_done) << "wait() rethrew while an on_finish callback was still running";
  finisher.join();
  EXPECT_FALSE(completed_in_callback) << "is_completed() was true before the callbacks had run";

  // The same on success, through synchronize(timeout); source_rank() answers
  // inside the callback.
  auto ok = std::make_shared<Work>("recv #0");
  ok->set_source_rank(2);
  std::atomic<bool> ok_done{false};
  ok->on_finish([&](const std::exception_ptr& error) {
    if (!error) source_in_callback = ok->source_rank();
    std::this_thread::sleep_for(300ms);
    ok_done = true;
  });
  std::thread ok_finisher([&] { ok->finish(); });
  ok->synchronize(10s);
  EXPECT_TRUE(ok_done);
  EXPECT_EQ(source_in_callback, 2);
  ok_finisher.join();
}

}  // namespace
}  // namespace dtrain
