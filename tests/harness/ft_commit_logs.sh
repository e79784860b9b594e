# Reading fault-tolerance commit logs (dtrain-ft-fashion-mnist --commit-log:
# "<step> <hash> <unix ms> <first sample> <samples> <quorum id> <members>"
# per commit;
# a line cut by a kill is skipped). Source it.

ft_commits() {  # ft_commits LOG: the number of whole lines
  awk 'NF >= 7 && length($2) == 16' "$1" 2>/dev/null | wc -l
}

# ft_never_stopped LOG LAST: every step from the log's first to LAST, once
# and in order (the replica committed through everything).
ft_never_stopped() {
  awk -v last="$2" 'NF >= 7 && length($2) == 16 { if (n && $1 != prev + 1) bad++; prev = $1; n++ }
    END { exit !(n > 0 && bad == 0 && prev == last) }' "$1"
}

# ft_steps_in_common LOG...: how many steps more than one log committed in
# one quorum, or "differ" when any of them holds another state or block of
# samples there. (A step committed in two quorums is a fork the lighthouse's
# lineage healed: docs/fault-tolerance.md.)
ft_steps_in_common() {
  awk 'NF >= 7 && length($2) == 16 { k = $1 " " $6; v = $2 " " $4 " " $5; if (k in seen) { n++; if (seen[k] != v) bad++ } else seen[k] = v }
    END { if (bad) print "differ"; else print n + 0 }' "$@"
}

ft_longest_wait() {  # ft_longest_wait LOG: the most ms between two commits
  awk 'NF >= 7 && length($2) == 16 { if (p && $3 - p > m) m = $3 - p; p = $3 } END { print m + 0 }' "$1"
}

# ft_rejoined OUT0 OUT1 LOG0 LOG1 STEPS: replica 1 healed when it came back,
# both finished STEPS steps, replica 0 missed none, and both hold the same
# state and samples at every step both committed (more than 50 of them: a
# busy machine may take many seconds to bring replica 1 back).
# Prints "<steps in common> <replica 0's longest wait in ms>", or what
# failed (and returns 1).
ft_rejoined() {
  local out0=$1 out1=$2 log0=$3 log1=$4 steps=$5 both
  grep -q "replica-1: step [0-9]* committed.*, healed" "$out1" || { echo "replica 1 did not heal"; return 1; }
  grep -q "replica-0: done, $steps steps committed" "$out0" || { echo "replica 0 did not finish"; return 1; }
  grep -q "replica-1: done, $steps steps committed" "$out1" || { echo "replica 1 did not finish"; return 1; }
  ft_never_stopped "$log0" "$steps" || { echo "replica 0 missed or repeated a step"; return 1; }
  both=$(ft_steps_in_common "$log0" "$log1")
  [ "$both" != differ ] && [ "$both" -gt 50 ] ||
    { echo "replica states or samples differ, or too few steps in common ($both)"; return 1; }
  echo "$both $(ft_longest_wait "$log0")"
}
