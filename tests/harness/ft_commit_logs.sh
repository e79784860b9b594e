# Reading fault-tolerance commit logs (dtrain-ft-fashion-mnist --commit-log:
# "<step> <hash> <unix ms> <first sample> <samples> <members>" per commit;
# a line cut by a kill is skipped). Source it.

ft_commits() {  # ft_commits LOG: the number of whole lines
  awk 'NF >= 6 && length($2) == 16' "$1" 2>/dev/null | wc -l
}

# ft_never_stopped LOG LAST: every step from the log's first to LAST, once
# and in order (the replica committed through everything).
ft_never_stopped() {
  awk -v last="$2" 'NF >= 6 && length($2) == 16 { if (n && $1 != prev + 1) bad++; prev = $1; n++ }
    END { exit !(n > 0 && bad == 0 && prev == last) }' "$1"
}

# ft_steps_in_common LOG...: how many steps more than one log committed,
# or "differ" when any of them holds another state or block of samples.
ft_steps_in_common() {
  awk 'NF >= 6 && length($2) == 16 { v = $2 " " $4 " " $5; if ($1 in seen) { n++; if (seen[$1] != v) bad++ } else seen[$1] = v }
    END { if (bad) print "differ"; else print n + 0 }' "$@"
}

ft_longest_wait() {  # ft_longest_wait LOG: the most ms between two commits
  awk 'NF >= 6 && length($2) == 16 { if (p && $3 - p > m) m = $3 - p; p = $3 } END { print m + 0 }' "$1"
}
