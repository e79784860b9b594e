// monitored_barrier: every rank reports to rank 0 with a 1-byte message, and
// rank 0 answers each once all have reported (1: pass). Rank 0 polls its
// receives (Request::done) instead of waiting on them, so that at the
// deadline it knows exactly which ranks never reported, and names them; the
// ranks that did report get 0 (fail) at once instead of waiting out their
// own timeout.

#include <chrono>
#include <thread>

#include "algorithms/internal.h"
#include "common/enforce.h"

namespace dtrain::algorithms {
namespace {

constexpr auto kVerdictGrace = std::chrono::seconds(1);

// The ranks whose report has not arrived by the deadline: all of them, or
// (all_ranks false) the first in rank order.
std::vector<int> missing_ranks(const Context& ctx,
                               const std::vector<transport::RequestPtr>& reports, bool all_ranks) {
  std::vector<int> missing;
  for (int j = 1; j < ctx.size(); ++j) {
    const auto& report = reports[static_cast<size_t>(j - 1)];
    while (!report->done() && transport::Clock::now() < ctx.deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (report->done()) {
      report->wait(ctx.deadline, ctx.what);  // rethrows its failure, if any
      continue;
    }
    missing.push_back(j);
    if (!all_ranks) break;
  }
  return missing;
}

}  // namespace

void monitored_barrier(const Context& ctx, std::chrono::milliseconds timeout, bool all_ranks) {
  auto& t = ctx.transport;
  uint8_t out = 1;
  if (ctx.rank() != 0) {
    uint8_t in = 0;
    auto release = t.irecv(0, ctx.tag, &in, 1);
    t.isend(0, ctx.tag, &out, 1)->wait(ctx.deadline, ctx.what);
    // Rank 0 judges at its own deadline, about when ours passes: its verdict
    // gets a grace period to arrive.
    release->wait(ctx.deadline + kVerdictGrace, ctx.what);
    if (in == 1) return;
    auto error = std::make_exception_ptr(TimeoutError(detail::cat(
        ctx.what, ": rank 0 found ranks that did not arrive within ", timeout.count(),
        " ms (its error names them)")));
    t.fail(error);
    std::rethrow_exception(error);
  }
  std::vector<uint8_t> in(static_cast<size_t>(ctx.size()), 0);
  std::vector<transport::RequestPtr> reports;
  for (int j = 1; j < ctx.size(); ++j) reports.push_back(t.irecv(j, ctx.tag, &in[j], 1));
  const auto missing = missing_ranks(ctx, reports, all_ranks);
  if (!missing.empty()) {
    // The ranks that arrived learn it at once (a second to hand it over).
    uint8_t failed = 0;
    std::vector<transport::RequestPtr> told;
    for (int j = 1; j < ctx.size(); ++j)
      if (reports[static_cast<size_t>(j - 1)]->done())
        told.push_back(t.isend(j, ctx.tag, &failed, 1));
    try {
      for (auto& r : told) r->wait(transport::Clock::now() + std::chrono::seconds(1), ctx.what);
    } catch (const Error&) {  // a rank that cannot be told times out by itself
    }
    auto error = std::make_exception_ptr(TimeoutError(detail::cat(
        ctx.what, ": ", missing.size() == 1 ? "rank " : "ranks ", detail::join(missing),
        " did not arrive within ", timeout.count(), " ms",
        all_ranks ? "" : " (the first such rank; wait_all_ranks names them all)")));
    t.fail(error);  // releases the receive buffers before they go out of scope
    std::rethrow_exception(error);
  }
  std::vector<transport::RequestPtr> releases;
  for (int j = 1; j < ctx.size(); ++j) releases.push_back(t.isend(j, ctx.tag, &out, 1));
  wait_all(ctx, releases);
}

}  // namespace dtrain::algorithms
