// Slurm's hostlists and the rendezvous endpoint derived from its variables.

#include <gtest/gtest.h>
#include <stdlib.h>

#include "common/slurm.h"
#include "dtrain/errors.h"

namespace dtrain::slurm {
namespace {

using Hosts = std::vector<std::string>;

TEST(SlurmHostlist, ExpandsRangesListsAndPadding) {
  EXPECT_EQ(expand_hostlist("n[1-2]", "L"), (Hosts{"n1", "n2"}));
  EXPECT_EQ(expand_hostlist("gpu-[01-03,07]", "L"), (Hosts{"gpu-01", "gpu-02", "gpu-03", "gpu-07"}));
  EXPECT_EQ(expand_hostlist("a,b[8-10],c", "L"), (Hosts{"a", "b8", "b9", "b10", "c"}));
  EXPECT_EQ(expand_hostlist("rack[1-2]-n[0-1]", "L"),
            (Hosts{"rack1-n0", "rack1-n1", "rack2-n0", "rack2-n1"}));
  EXPECT_EQ(expand_hostlist("node-17.cluster", "L"), (Hosts{"node-17.cluster"}));
  EXPECT_EQ(expand_hostlist("n[0-999999]", "L", 3), (Hosts{"n0", "n1", "n2"})) << "capped";
}

TEST(SlurmHostlist, MalformedListsAreNamed) {
  auto what = [](const std::string& list) {
    try {
      expand_hostlist(list, "SLURM_STEP_NODELIST='" + list + "'");
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(what("n[1-2"), "SLURM_STEP_NODELIST='n[1-2': unbalanced '[' in 'n[1-2'");
  EXPECT_EQ(what("n[2-1]"), "SLURM_STEP_NODELIST='n[2-1]': range 2-1 runs backwards");
  EXPECT_EQ(what("n[a-b]"),
            "SLURM_STEP_NODELIST='n[a-b]': '[a-b]' is not a Slurm range (expected numbers like [1-4,7])");
  EXPECT_EQ(what("n1,,n2"), "SLURM_STEP_NODELIST='n1,,n2': empty host name in ''");
  EXPECT_EQ(what(""), "SLURM_STEP_NODELIST='' is empty");
}

TEST(SlurmHostlist, StepsOfAJobGetDifferentPorts) {
  EXPECT_EQ(rendezvous_port(0, 0), 15000);
  for (long long job : {1LL, 4242LL, 987654321LL}) {
    for (long long step = 0; step < 50; ++step) {
      const int p = rendezvous_port(job, step);
      EXPECT_GE(p, 15000);
      EXPECT_LT(p, 55000);
      EXPECT_NE(p, rendezvous_port(job, step + 1)) << "job " << job << " step " << step;
    }
  }
}

TEST(SlurmEnvironment, StepNodelistAndJobIdGiveTheEndpoint) {
  setenv("SLURM_JOB_NODELIST", "login[1-4]", 1);
  setenv("SLURM_STEP_NODELIST", "localhost,n2", 1);
  setenv("SLURM_JOB_ID", "4242", 1);
  setenv("SLURM_STEP_ID", "3", 1);
  EXPECT_EQ(master_addr_from_slurm(), "localhost") << "the step's list wins over the job's";
  EXPECT_EQ(master_port_from_slurm(), rendezvous_port(4242, 3));
  unsetenv("SLURM_STEP_NODELIST");
  unsetenv("SLURM_STEP_ID");
  EXPECT_EQ(master_addr_from_slurm(), "login1");
  EXPECT_EQ(master_port_from_slurm(), rendezvous_port(4242, 0));
  unsetenv("SLURM_JOB_NODELIST");
  unsetenv("SLURM_JOB_ID");
  EXPECT_EQ(master_addr_from_slurm(), std::nullopt);
  EXPECT_EQ(master_port_from_slurm(), std::nullopt);
}

}  // namespace
}  // namespace dtrain::slurm
