#!/usr/bin/env bash
# A two-node Slurm cluster on this machine, for one command:
#   slurm_cluster.sh COMMAND [ARGS...]
# starts munged and slurmctld plus two slurmd (nodes n1 and n2, both at
# 127.0.0.1), waits until both nodes are idle, runs COMMAND with the
# cluster's SLURM_CONF, then stops every daemon by its PID, also when the
# command or the bring-up fails. Exits with COMMAND's status; a cluster
# that cannot start is a failure (exit 1), never a skip. Needs root and
# Debian's slurm-wlm and munge.
set -u
dir=$(mktemp -d /tmp/dtrain-slurm-XXXXXX)
pids=()
# Every process of this cluster's jobs (srun, and what mpirun starts through
# it) has SLURM_CONF pointing here: none may outlive the cluster.
strays() {
  local e
  for e in /proc/[0-9]*/environ; do
    tr '\0' '\n' 2>/dev/null <"$e" | grep -qxF "SLURM_CONF=$dir/slurm.conf" &&
      basename "$(dirname "$e")"
  done
}
cleanup() {
  local daemons=" ${pids[*]} $$ "
  for p in $(strays); do [[ "$daemons" == *" $p "* ]] || kill -9 "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null
  done
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "slurm_cluster: $*" >&2; for f in "$dir"/*.log; do echo "--- $f"; tail -20 "$f"; done >&2; exit 1; }
for tool in munged slurmctld slurmd srun sinfo; do
  command -v $tool >/dev/null || fail "$tool is missing (install slurm-wlm and munge)"
done
chmod 755 "$dir"
mkdir -p "$dir"/{state,spooln1,spooln2,munge} /run/munge  # SlurmdSpoolDir=spool%n
chown munge:munge "$dir/munge" /run/munge
[ -f /etc/munge/munge.key ] || fail "/etc/munge/munge.key is missing (the munge package creates it)"
runuser -u munge -- munged --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
  --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" || fail "munged did not start"
for _ in $(seq 50); do [ -s "$dir/munge/munged.pid" ] && break; sleep 0.1; done
pids+=("$(cat "$dir/munge/munged.pid")")
cpus=$(nproc)
port=$((17000 + RANDOM % 2000))
# Job ids whose derived rendezvous ports (15000 + (id * 1009 + step) mod
# 40000, docs/launcher.md) stay below 27000 for the first ten jobs: under the
# kernel's ephemeral range (32768 and up), so a port another test holds for
# a moment cannot collide with a job's store.
first_job=$((1000 + RANDOM))
while [ $((first_job * 1009 % 40000)) -gt 1900 ]; do first_job=$((1000 + RANDOM)); done
cat > "$dir/slurm.conf" <<CONF
ClusterName=dtrain
FirstJobId=$first_job
SlurmctldHost=localhost
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MailProg=/bin/true
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmdParameters=config_overrides
SlurmUser=root
ReturnToService=2
NodeName=n1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=$((cpus * 2)) State=UNKNOWN
NodeName=n2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((port + 3)) CPUs=$((cpus * 2)) State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -D -i -f "$SLURM_CONF" >"$dir/ctld.out.log" 2>&1 &
pids+=($!)
for n in n1 n2; do
  slurmd -D -N $n -f "$SLURM_CONF" >"$dir/slurmd-$n.out.log" 2>&1 &
  pids+=($!)
done
up=0
for _ in $(seq 100); do
  if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle')" = 2 ]; then up=1; break; fi
  sleep 0.2
done
[ "$up" = 1 ] || fail "the nodes did not become idle: $(sinfo -N 2>&1)"
"$@"
