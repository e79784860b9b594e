#!/usr/bin/env bash
# examples/slurm/ft.sbatch under a real two-node Slurm (slurm_cluster.sh):
# two replicas of two ranks, each a job step on its node, around the
# lighthouse on the batch host. Replica 1's step is cancelled mid-run
# (scancel JOB.STEP: its dtrain-run and workers killed); the script launches
# it again as a new step, it heals from replica 0 and both commit to the
# end, while replica 0 never stops: every step it committed from its first
# to the last, the same state as replica 1 at every step both committed.
#   ft_sbatch_test.sh DTRAIN_RUN TRAIN LIGHTHOUSE SCRIPT
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/dtrain-ft-sbatch-XXXXXX)
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT
cat >"$work/scenario.sh" <<'SCENARIO'
set -eu
run=$1 train=$2 lighthouse=$3 script=$4 work=$5
source "$6"
cd "$work"
fail() {
  echo "ft sbatch: FAIL: $*"
  for f in "$work"/*.out "$work"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -25 "$f"; }; done
  squeue -s 2>&1 | head
  exit 1
}
wait_for() {  # wait_for SECONDS COMMAND...: until it succeeds
  local limit=$1; shift
  for _ in $(seq $((limit * 5))); do "$@" && return 0; sleep 0.2; done
  return 1
}
has_commits() { [ "$(ft_commits "$1")" -ge "$2" ]; }
job_gone() { [ -z "$(squeue -h -j "$1" 2>/dev/null)" ]; }
steps=900
export DTRAIN_RUN=$run TRAIN=$train LIGHTHOUSE=$lighthouse NPROC_PER_NODE=2 HEARTBEAT_TIMEOUT=1 RELAUNCH_AFTER=2
job=$(sbatch --parsable --nodes=2 "$script" --steps $steps --step-ms 20 --log-every 100 \
  --commit-log "$work/replica-%r.log" | cut -d';' -f1) || fail "sbatch refused the script"
wait_for 120 has_commits "$work/replica-1.log" 60 || fail "replica 1 did not commit 60 steps"
step=$(squeue -h -s -j "$job" -o '%i %j' | awk '$2 == "replica-1" { print $1 }')
[ -n "$step" ] || fail "no step named replica-1 in job $job"
scancel "$step"
echo "ft sbatch: cancelled step $step (replica 1) after $(ft_commits "$work/replica-1.log") commits"
wait_for 240 job_gone "$job" || fail "job $job did not finish"
out="dtrain-ft-$job.out"
grep -q "ft.sbatch: replica 1's step ended; launching it again in 2 s" "$out" || fail "the script did not relaunch replica 1"
result=$(ft_rejoined "$out" "$out" "$work/replica-0.log" "$work/replica-1.log" $steps) || fail "$result"
read -r both longest <<<"$result"
echo "ft sbatch: replica 1 relaunched as a new step and healed; replica 0 never stopped (longest wait between commits $longest ms); $both steps equal on both"
SCENARIO
env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK \
  bash "$here/slurm_cluster.sh" bash "$work/scenario.sh" "$1" "$2" "$3" "$4" "$work" "$here/../harness/ft_commit_logs.sh"
