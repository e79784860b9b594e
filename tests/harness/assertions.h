#pragma once

// Small helpers shared by the tests.

#include <gtest/gtest.h>

#include <chrono>
#include <string>

namespace dtrain::testing {

// Sanitizers slow the code under test several times over; time bounds
// scale with this.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kSanitizerSlowdown = 10;
#else
constexpr int kSanitizerSlowdown = 1;
#endif

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// EXPECT_TRUE(Contains(e.what(), "2/3 joined")) prints both strings on failure.
inline ::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\n  does not contain \"" << part
                                       << "\"";
}

// The message of the E that `fn` throws; a failure when it throws nothing
// or something else.
template <typename E, typename F>
std::string what_thrown(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no exception";
  return "";
}

}  // namespace dtrain::testing
