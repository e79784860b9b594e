// The group runtime: every operation is one descriptor (Op) through one
// issue(), and every backend keeps its broken state in one FailureState
// with one failure policy.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "core/failure_state.h"
#include "dtrain/backend_hooks.h"
#include "dtrain/distributed.h"
#include "dtrain/store/hash_store.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::expect_no_errors;
using testing::run_ranks;

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

Op op_of(OpType type, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
         int root = -1) {
  Op op;
  op.type = type;
  op.inputs = std::move(inputs);
  op.outputs = std::move(outputs);
  op.root = root;
  return op;
}

// Descriptors built by hand give what the named methods give, on every
// CPU backend, and are numbered among them.
TEST(GroupRuntime, DescriptorsIssueEveryKindOfOperation) {
  for (const std::string backend : {"tcp", "shm", "auto"}) {
    SCOPED_TRACE(backend);
    expect_no_errors(run_ranks(3, [&](ProcessGroup& g) {
      const int r = g.rank();
      auto t = at::full({4}, r + 1.0);
      auto sum = op_of(OpType::ALL_REDUCE, {}, {t});
      auto work = g.issue(sum);
      work->wait();
      EXPECT_TRUE(at::equal(t, at::full({4}, 6.0)));
      EXPECT_EQ(work->description().rfind("all_reduce #0 on group", 0), 0u) << work->description();

      auto flat = at::zeros({3, 2}, at::kLong);
      g.issue(op_of(OpType::ALL_GATHER_INTO_TENSOR, {at::full({1, 2}, r * 10, at::kLong)}, {flat}))
          ->wait();
      EXPECT_TRUE(at::equal(flat, at::tensor({0, 0, 10, 10, 20, 20}, at::kLong).view({3, 2})));

      auto max = op_of(OpType::REDUCE_SCATTER_TENSOR, {at::arange(6, at::kInt) * (r + 1)},
                       {at::zeros({2}, at::kInt)});
      max.reduce_op = ReduceOp::MAX;
      auto out = max.outputs[0];
      g.issue(max)->wait();
      EXPECT_TRUE(at::equal(out, at::tensor({2 * r, 2 * r + 1}, at::kInt) * 3));

      // A message around the ring, with tags.
      auto got = at::zeros({2});
      auto send = op_of(OpType::SEND, {at::full({2}, double(r))}, {}, (r + 1) % 3);
      auto recv = op_of(OpType::RECV, {}, {got}, (r + 2) % 3);
      send.tag = recv.tag = 7;
      auto rw = g.issue(recv);
      g.issue(send)->wait();
      rw->wait();
      EXPECT_EQ(rw->source_rank(), (r + 2) % 3);
      EXPECT_TRUE(at::equal(got, at::full({2}, double((r + 2) % 3))));

      auto barrier = g.issue(op_of(OpType::BARRIER, {}, {}));
      barrier->wait();
      EXPECT_EQ(barrier->description().rfind("barrier #3 on group", 0), 0u)
          << barrier->description();
    }, 30s, GroupOptions(), backend));
  }
}

// A descriptor whose lists do not fit its type is refused before anything
// is numbered or sent, naming the operation; the group goes on.
TEST(GroupRuntime, AMalformedDescriptorIsRefusedNamingIt) {
  expect_no_errors(run_ranks(2, [&](ProcessGroup& g) {
    auto wrong = op_of(OpType::ALL_REDUCE, {at::ones({2})}, {});
    try {
      g.issue(wrong);
      ADD_FAILURE() << "a malformed descriptor was issued";
    } catch (const InvalidArgument& e) {
      EXPECT_STREQ(e.what(), "all_reduce: a descriptor of this operation holds 0 input(s) and 1 "
                             "output(s), got 1 and 0");
    }
    auto two_inputs = op_of(OpType::ALL_GATHER, {at::ones({1}), at::ones({1})},
                            {at::ones({1}), at::ones({1})});
    EXPECT_THROW(g.issue(two_inputs), InvalidArgument);
    auto t = at::ones({2});
    auto work = g.all_reduce(t);
    work->wait();
    EXPECT_EQ(work->description().rfind("all_reduce #0 on group", 0), 0u) << work->description();
    EXPECT_TRUE(at::equal(t, at::full({2}, 2.0)));
  }));
}

// A backend of one's own writes the hooks it runs; one it leaves out fails
// with BackendUnavailable naming the backend and the operation.
class SumOnlyGroup final : public ProcessGroup {
 public:
  SumOnlyGroup() : ProcessGroup(0, 1, GroupOptions().name("mine")) {}
  std::string backend_name() const override { return "sum-only"; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  WorkPtr do_all_reduce(const Call& call, at::Tensor, ReduceOp) override {
    return Work::completed(call.description);
  }
};

TEST(GroupRuntime, AHookABackendLeavesOutFailsNamingIt) {
  SumOnlyGroup g;
  auto t = at::ones({2});
  g.all_reduce(t)->wait();
  try {
    g.broadcast(t, 0);
    ADD_FAILURE() << "broadcast ran without a hook";
  } catch (const BackendUnavailable& e) {
    EXPECT_STREQ(e.what(), "backend 'sum-only' (group 'mine') does not implement broadcast");
  }
}

// A Backend of one's own (backend.h) that stands for rank 0 of four equal
// ranks: its all_reduce multiplies by 4, as a sum of four equal tensors
// would. It runs only all_reduce, and does not average.
class FourEqualRanksBackend final : public Backend {
 public:
  FourEqualRanksBackend(const GroupOptions& options, std::vector<ReduceOp>* seen)
      : Backend(0, 4, options), seen_(seen) {}
  std::string backend_name() const override { return "four-equal-ranks"; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  WorkPtr do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op) override {
    seen_->push_back(op);
    tensor.mul_(4);
    return Work::completed(call.description);
  }

 private:
  std::vector<ReduceOp>* seen_;
};

// Registered with its device type, it is the backend of a group that
// create_process_group builds; the group hands it SUM for AVG and divides
// by the group's size itself (truncating integers), since it does not
// average; a hook it leaves out fails naming it.
TEST(GroupRuntime, ABackendOfOnesOwnGetsSumForAvgAndTheGroupDivides) {
  std::vector<ReduceOp> seen;
  register_backend("four-equal-ranks", {c10::DeviceType::CPU},
                   [&seen](std::shared_ptr<Store>, int, int, const GroupOptions& options) {
                     return std::make_shared<FourEqualRanksBackend>(options, &seen);
                   });
  auto g = create_process_group("four-equal-ranks", std::make_shared<HashStore>(5s), 0, 4,
                                GroupOptions().name("mine"));
  EXPECT_EQ(g->backend_name(), "four-equal-ranks");
  auto f = at::tensor({1.5, -3.0, 7.25});
  g->all_reduce(f, ReduceOp::AVG)->wait();
  EXPECT_TRUE(at::equal(f, at::tensor({1.5, -3.0, 7.25}))) << f;
  auto i = at::tensor({5, -7, 9}, at::kInt);
  g->all_reduce(i, ReduceOp::AVG)->wait();
  EXPECT_TRUE(at::equal(i, at::tensor({5, -7, 9}, at::kInt))) << i;
  g->all_reduce(f, ReduceOp::SUM)->wait();
  EXPECT_TRUE(at::equal(f, at::tensor({6.0, -12.0, 29.0}))) << f;
  EXPECT_EQ(seen, (std::vector<ReduceOp>{ReduceOp::SUM, ReduceOp::SUM, ReduceOp::SUM}));
  try {
    g->broadcast(f, 0);
    ADD_FAILURE() << "broadcast ran without a hook";
  } catch (const BackendUnavailable& e) {
    EXPECT_STREQ(e.what(), "backend 'four-equal-ranks' (group 'mine') does not implement broadcast");
  }
}

// The one failure policy: an error raised in step fails its operation
// only; anything else breaks the group, and every later operation fails at
// once without running, naming the first error.
TEST(FailureState, InStepErrorsFailOneOperationOthersBreakTheGroup) {
  FailureState state;
  std::atomic<int> breaks{0};
  state.on_break([&](const std::exception_ptr&) { ++breaks; });

  Work mismatch("all_reduce #0");
  state.run(mismatch, [] { throw CollectiveMismatch("shapes differ"); });
  EXPECT_EQ(message_of(mismatch.exception()), "shapes differ");
  EXPECT_FALSE(state.error());

  Work timeout("all_reduce #1");
  state.run(timeout, [] { throw TimeoutError("rank 1 did not answer"); });
  EXPECT_EQ(message_of(timeout.exception()), "rank 1 did not answer");
  EXPECT_EQ(breaks.load(), 1);

  bool ran = false;
  Work later("broadcast #2");
  state.run(later, [&] { ran = true; });
  EXPECT_FALSE(ran);
  EXPECT_EQ(message_of(later.exception()),
            "broadcast #2 cannot run: the group is broken by an earlier error (rank 1 did not "
            "answer); destroy it and create a new one");
  state.break_with(std::make_exception_ptr(NetworkError("second")));
  EXPECT_EQ(message_of(state.error()), "rank 1 did not answer") << "the first error is kept";
}

// A state kept elsewhere (a transport's) breaks the group too, and is the
// error named; a backend may say which of its errors are raised in step.
TEST(FailureState, AWatchedSourceAndABackendsOwnInStepErrors) {
  FailureState state([](const std::exception_ptr& e) { return message_of(e) == "in step"; });
  std::exception_ptr transport;
  state.watch([&] { return transport; });
  Work argument("gather #0");
  state.run(argument, [] { throw InvalidArgument("not in step here"); });
  EXPECT_EQ(message_of(state.error()), "not in step here");

  FailureState watched;
  transport = std::make_exception_ptr(NetworkError("peer 2 closed the connection"));
  watched.watch([&] { return transport; });
  Work w("scatter #4");
  EXPECT_TRUE(watched.refuse(w));
  EXPECT_EQ(message_of(w.exception()),
            "scatter #4 cannot run: the group is broken by an earlier error (peer 2 closed the "
            "connection); destroy it and create a new one");
}

// What a backend is told of how its caller waits (Call::blocking).
class BlockingSeenBackend final : public Backend {
 public:
  BlockingSeenBackend(const GroupOptions& options, std::vector<bool>* seen)
      : Backend(0, 2, options), seen_(seen) {}
  std::string backend_name() const override { return "blocking-seen"; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  WorkPtr do_all_reduce(const Call& call, at::Tensor, ReduceOp) override {
    seen_->push_back(call.blocking);
    return Work::completed(call.description);
  }
  WorkPtr do_all_gather_into_tensor(const Call& call, at::Tensor, at::Tensor) override {
    seen_->push_back(call.blocking);  // the fingerprint check under DTRAIN_DEBUG=DETAIL
    return Work::completed(call.description);
  }

 private:
  std::vector<bool>* seen_;
};

// A torch.distributed-style call without async_op is blocking; one with
// it, a group's own method, and any operation after the first in the
// same call are not.
TEST(GroupRuntime, OnlyACallWithoutAsyncOpIsBlocking) {
  std::vector<bool> seen;
  register_backend("blocking-seen", {c10::DeviceType::CPU},
                   [&seen](std::shared_ptr<Store>, int, int, const GroupOptions& options) {
                     return std::make_shared<BlockingSeenBackend>(options, &seen);
                   });
  auto g = create_process_group("blocking-seen", std::make_shared<HashStore>(5s), 0, 2,
                                GroupOptions().name("blocking"));
  auto t = at::ones({4});
  all_reduce(t, AllReduceOptions().group(g));
  all_reduce(t, AllReduceOptions().group(g).async_op(true))->wait();
  g->all_reduce(t)->wait();
  all_reduce(t, AllReduceOptions().group(g));
  EXPECT_EQ(seen, (std::vector<bool>{true, false, false, true}));
}

}  // namespace
}  // namespace dtrain
