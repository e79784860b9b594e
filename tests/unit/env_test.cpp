// The environment-variable registry: documented, typed, and strict.

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "common/env.h"
#include "common/logging.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

TEST(EnvRegistry, EveryVariableIsDocumented) {
  std::ifstream in(std::string(DTRAIN_SOURCE_DIR) + "/docs/env-vars.md");
  ASSERT_TRUE(in) << "docs/env-vars.md is missing";
  std::stringstream doc;
  doc << in.rdbuf();
  for (const auto* var : env::all())
    EXPECT_NE(doc.str().find(std::string("| `") + var->name + "` |"), std::string::npos)
        << var->name << " is not listed in docs/env-vars.md";
}

TEST(EnvRegistry, IntegersAreValidatedNamingTheVariable) {
  setenv("WORLD_SIZE", "12", 1);
  EXPECT_EQ(env::get_int(env::kWorldSize, 1, 100), 12);
  setenv("WORLD_SIZE", "12x", 1);
  try {
    env::get_int(env::kWorldSize, 1, 100);
    ADD_FAILURE() << "no error for 12x";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "environment variable WORLD_SIZE='12x' is not an integer");
  }
  setenv("WORLD_SIZE", "0", 1);
  try {
    env::get_int(env::kWorldSize, 1, 100);
    ADD_FAILURE() << "no error for 0";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "environment variable WORLD_SIZE=0 is out of range (expected 1..100)");
  }
  unsetenv("WORLD_SIZE");
  EXPECT_FALSE(env::get_int(env::kWorldSize, 1, 100).has_value());
  EXPECT_EQ(env::get_int(env::kTimeout, 1, 100000), 1800);  // the declared default
}

TEST(EnvRegistry, DebugLevels) {
  EXPECT_EQ(parse_debug_level("detail"), DebugLevel::Detail);
  EXPECT_EQ(parse_debug_level("INFO"), DebugLevel::Info);
  EXPECT_EQ(parse_debug_level(""), DebugLevel::Off);
  EXPECT_THROW(parse_debug_level("LOUD"), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
