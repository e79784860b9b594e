#!/usr/bin/env bash
# dtrain-llama end to end under dtrain-run, on a tiny model (2 layers, width
# 32, 16-byte sequences, batch 8, 20 steps):
# - every layout of the same batch has one process's per-step losses within
#   1e-4 relative: TP 2, TP 2 with SP and activation checkpointing (and
#   selective checkpointing, the same losses as full), PP 2,
#   DP 2 under FSDP, TP 2 x DP 2 under FSDP with SP, PP 2 x DP 2 x TP 2;
# - a run killed at step 12 and restarted by dtrain-run resumes from its
#   step-10 checkpoint with the uninterrupted run's losses, bit for bit, with
#   dropout on; so does FSDP 2 x PP 2; checkpoints resume in other layouts
#   (8 ranks' in one process, TP 2 x FSDP 2's at PP 2 x DDP 2);
# - mixture-of-experts layers at DP 4 x EP 2 and PP 2 x DP 2 (EP 2) x TP 2
#   with SP have one process's losses (selective checkpointing: the same
#   losses as none); DP 4 x EP 2 killed at step 12
#   resumes bitwise; the 8-rank checkpoint resumes in one process;
# - context parallelism at CP 2 (ring and Ulysses), CP 2 x TP 2 + SP,
#   CP 2 x FSDP 2 and PP 2 x CP 2 has one process's losses within 5e-7;
# - metrics, plot and sample text are written; bad layouts are named.
set -euo pipefail
run=$1 llama=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -15 "$f"; done; exit 1; }
tiny=(--dim 32 --layers 2 --heads 4 --hidden 64 --seq 16 --batch 8 --microbatches 2 --steps 20
      --log-every 5 --sample-bytes 40 --print-losses)

job() {  # job NAME NPROC [dtrain-run flags] -- [program flags]
  local name=$1 n=$2; shift 2
  local launcher=()
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done; shift
  "$run" --standalone --nproc-per-node "$n" "${launcher[@]}" "$llama" "${tiny[@]}" --out-dir "runs/$name" \
    --checkpoint-dir "ck/$name" "$@" >"$name.log" 2>&1
}
losses() { grep -o '^\[0\]:step [0-9]* loss [-0-9.e+]*' "$1.log" | awk '{print $2, $4}'; }
# The largest relative difference between two runs' losses at the steps both have.
worst() {
  join <(losses "$1" | sort -k1,1) <(losses "$2" | sort -k1,1) | awk '{d = $2 - $3; d = d < 0 ? -d : d; r = d / ($3 < 0 ? -$3 : $3);
    if (r > w) w = r; n++} END {if (n == 0) print "none"; else printf "%.3g %d\n", w, n}'
}
expect_close() {  # expect_close NAME REFERENCE BOUND
  local got; got=$(worst "$1" "$2")
  [ "$got" != none ] || fail "$1: no losses in common with $2"
  awk -v w="${got% *}" -v b="$3" 'BEGIN {exit !(w <= b)}' || fail "$1: losses differ from $2 by $got (> $3)"
  echo "$1: ${got#* } step losses within ${got% *} of $2"
}

job one 1 -- || fail "one process"
[ "$(losses one | wc -l)" = 20 ] || fail "one process: not 20 losses"
test -s runs/one/metrics.jsonl || fail "no metrics.jsonl"
test -s runs/one/loss.png || fail "no loss.png"
grep -q '^\[0\]:sample:' one.log || fail "no sample text"
first=$(losses one | head -1 | awk '{print $2}') last=$(losses one | tail -1 | awk '{print $2}')
awk -v a="$first" -v b="$last" 'BEGIN {exit !(b < a - 0.5)}' || fail "the loss did not fall ($first -> $last)"

job tp2 2 -- --tp 2 || fail "TP 2"
expect_close tp2 one 1e-4
job tp2-sp-ac 2 -- --tp 2 --sequence-parallel --checkpoint-activations || fail "TP 2, SP, AC"
expect_close tp2-sp-ac one 1e-4
# Selective checkpointing: bitwise the gradients of full checkpointing (both
# are the plain run's), so the same printed losses.
job tp2-sp-sac 2 -- --tp 2 --sequence-parallel --checkpoint-activations --keep-matmul-outputs ||
  fail "TP 2, SP, selective AC"
[ "$(losses tp2-sp-sac)" = "$(losses tp2-sp-ac)" ] || fail "tp2-sp-sac: losses differ from tp2-sp-ac"
echo "tp2-sp-sac: the same losses as tp2-sp-ac"
job pp2 2 -- --pp 2 || fail "PP 2"
expect_close pp2 one 1e-4
job fsdp2 2 -- --dp 2 --data-parallel fsdp || fail "FSDP 2"
expect_close fsdp2 one 1e-4
job fsdp-pp 4 -- --dp 2 --pp 2 --data-parallel fsdp --checkpoint-every 5 || fail "FSDP 2 x PP 2"
expect_close fsdp-pp one 1e-4
job fsdp-pp-crash 4 --max-restarts 1 -- --dp 2 --pp 2 --data-parallel fsdp --checkpoint-every 5 \
  --crash-at-step 7 || fail "FSDP 2 x PP 2 killed at step 7 did not finish after its restart"
grep -q "resumed from ck/fsdp-pp-crash at step 5" fsdp-pp-crash.log || fail "FSDP: no resume at step 5"
[ "$(losses fsdp-pp-crash | awk '$1 > 5' | sort -n | uniq)" = "$(losses fsdp-pp | awk '$1 > 5')" ] \
  || fail "FSDP: the resumed run's losses are not the uninterrupted run's"
echo "FSDP x PP killed at step 7, resumed from step 5: steps 6-20 bitwise the uninterrupted run's"
job tp2-fsdp2 4 -- --tp 2 --dp 2 --data-parallel fsdp --sequence-parallel || fail "TP 2 x FSDP 2"
expect_close tp2-fsdp2 one 1e-4
grep -q '^\[0\]:sample:' tp2-fsdp2.log || fail "TP x FSDP: no sample text (from its checkpoint)"
job 3d 8 -- --tp 2 --pp 2 --dp 2 || fail "PP 2 x DP 2 x TP 2"
expect_close 3d one 1e-4

# Exact resume with dropout: killed after step 12, restarted from step 10.
job drop 8 -- --tp 2 --pp 2 --dp 2 --dropout 0.1 --checkpoint-every 5 || fail "dropout run"
job drop-crash 8 --max-restarts 1 -- --tp 2 --pp 2 --dp 2 --dropout 0.1 --checkpoint-every 5 \
  --crash-at-step 12 || fail "the run killed at step 12 did not finish after its restart"
grep -q "resumed from ck/drop-crash at step 10" drop-crash.log || fail "no resume at step 10"
[ "$(losses drop-crash | awk '$1 > 10' | sort -n | uniq)" = "$(losses drop | awk '$1 > 10')" ] \
  || fail "the resumed run's losses are not the uninterrupted run's"
echo "killed at step 12, resumed from step 10: steps 11-20 bitwise the uninterrupted run's"
if [ "$(losses drop)" = "$(losses 3d)" ]; then fail "dropout changed nothing"; fi

# Checkpoints of step 20 resumed in other layouts for 5 more steps: the
# 8-rank DDP one in one process, TP 2 x FSDP 2's at PP 2 x DDP 2.
job one-25 1 -- --steps 25 || fail "one process, 25 steps"
cp -r ck/3d ck/more
job more 1 -- --resume --steps 25 || fail "resume of the 8-rank checkpoint in one process"
grep -q "resumed from ck/more at step 20 (written by 8 ranks" more.log || fail "no resume line"
expect_close more one-25 1e-4
cp -r ck/tp2-fsdp2 ck/more-pp
job more-pp 4 -- --resume --steps 25 --pp 2 --dp 2 || fail "resume of TP x FSDP's checkpoint at PP 2 x DDP 2"
grep -q "resumed from ck/more-pp at step 20 (written by 4 ranks" more-pp.log || fail "no resume line (PP 2 x DDP 2)"
expect_close more-pp one-25 1e-4

# Mixture of experts (4 experts, top 2, a shared expert): one process
# against EP 2 within DP 4 (each expert on two ranks, averaged over them)
# and PP 2 x DP 2 (EP 2) x TP 2 with SP (the MoE routes each rank's
# sequence shard; its gradients summed over TP); that checkpoint resumed
# in one process.
moe=(--experts 4 --top-k 2 --shared-expert)
job moe-one 1 -- "${moe[@]}" --steps 25 || fail "MoE, one process"
grep -q '^\[0\]:step 20 expert load: min [0-9.]*, max [0-9.]* of the mean' moe-one.log || fail "MoE: no load line"
# Selective checkpointing keeps the router's, experts' and shared expert's
# multiplies too: bitwise the plain run's gradients, so the same losses.
job moe-sac 1 -- "${moe[@]}" --steps 25 --checkpoint-activations --keep-matmul-outputs || fail "MoE, selective AC"
[ "$(losses moe-sac)" = "$(losses moe-one)" ] || fail "moe-sac: losses differ from moe-one"
echo "moe-sac: the same losses as moe-one"
# TP 2 without SP: the MoE whole on both TP ranks, routing the same tokens;
# its gradients are each rank's own, not summed over TP.
job moe-tp2 2 -- "${moe[@]}" --tp 2 || fail "MoE, TP 2"
expect_close moe-tp2 moe-one 1e-6  # (Adam hides a doubled gradient: summed over TP it moved the losses ~1e-5)
job moe-dp4 4 -- "${moe[@]}" --dp 4 --ep 2 || fail "MoE, DP 4 x EP 2"
expect_close moe-dp4 moe-one 1e-4
# Under FSDP the experts are sharded over the two ranks holding them (edp),
# the rest over all four: killed at step 12, resumed from step 10, steps 11
# and 12 run again bitwise as before; its checkpoint resumes in one process.
job moe-fsdp 4 --max-restarts 1 -- "${moe[@]}" --dp 4 --ep 2 --data-parallel fsdp --checkpoint-every 5 \
  --crash-at-step 12 || fail "MoE, FSDP 4 x EP 2 killed at step 12 did not finish after its restart"
grep -q "resumed from ck/moe-fsdp at step 10" moe-fsdp.log || fail "MoE FSDP: no resume at step 10"
[ "$(losses moe-fsdp | awk '$1 == 11 || $1 == 12' | sort -u | wc -l)" = 2 ] \
  || fail "MoE FSDP: steps 11 and 12 after the resume are not those before the kill"
expect_close moe-fsdp moe-one 1e-4
echo "MoE under FSDP killed at step 12, resumed from step 10: steps 11-12 bitwise as before"
cp -r ck/moe-fsdp ck/moe-fsdp-more
job moe-fsdp-more 1 -- "${moe[@]}" --resume --steps 25 || fail "resume of the MoE FSDP checkpoint in one process"
expect_close moe-fsdp-more moe-one 1e-4
job moe-3d 8 -- "${moe[@]}" --pp 2 --dp 2 --ep 2 --tp 2 --sequence-parallel --export-safetensors hf-moe \
  || fail "MoE, PP 2 x DP 2 (EP 2) x TP 2 + SP"
expect_close moe-3d moe-one 1e-4
# The header: its length (8 bytes, little-endian), then that much JSON. (In
# a pipeline into grep -q, head could die of SIGPIPE when grep stopped at
# its match, and pipefail failed the check: seen in CI.)
header_bytes=$(od -An -tu8 -N8 hf-moe/model.safetensors | tr -d ' ')
header=$(head -c $((8 + header_bytes)) hf-moe/model.safetensors | tail -c +9)
for name in layers.0.moe.experts.3.gate_proj.weight layers.1.moe.experts.0.down_proj.weight \
            layers.1.moe.router.gate.weight; do
  [[ $header == *"\"$name\""* ]] || fail "MoE export: no tensor $name"
done
grep -q "experts over ep 2" moe-3d.log || fail "MoE: the layout line does not name EP"
cp -r ck/moe-3d ck/moe-more
job moe-more 1 -- "${moe[@]}" --resume --steps 25 || fail "resume of the MoE 8-rank checkpoint in one process"
grep -q "resumed from ck/moe-more at step 20 (written by 8 ranks" moe-more.log || fail "MoE: no resume line"
expect_close moe-more moe-one 1e-4
job bad-ep 2 -- "${moe[@]}" --ep 3 && fail "--ep 3 on 2 data-parallel ranks ran"
grep -q "dtrain-llama: --ep 3 does not divide --dp 2" bad-ep.log || fail "--ep 3: no error"
job bad-ep-dense 2 -- --ep 2 && fail "--ep 2 without experts ran"
grep -q "dtrain-llama: --ep 2 without --experts" bad-ep-dense.log || fail "--ep without experts: no error"
job bad-experts 2 -- --experts 3 --ep 2 && fail "3 experts over EP 2 ran"
grep -q "3 experts" bad-experts.log || fail "3 experts over EP 2: no error"
echo "MoE: DP 4 x EP 2 and PP 2 x DP 2 x EP 2 x TP 2 + SP as one process; resumed in one process; bad layouts named"

# Context parallelism: every sequence split head-tail over the CP ranks
# (ring attention; Ulysses at CP 2), alone and with TP 2 + SP, FSDP 2 and
# PP 2, within 5e-7 of one process (1.6e-7 measured: the online softmax
# rounds otherwise), and with experts (EP 2 within DP 4 and DP 2, each
# expert's gradient averaged over its edp x cp holders) within 1e-6; the
# CP 2 x TP 2 checkpoint resumes in one process.
job cp2 2 -- --cp 2 || fail "CP 2"
grep -q "x cp 2 (ring)" cp2.log || fail "CP: the layout line does not name CP"
expect_close cp2 one 5e-7
job cp2-ulysses 2 -- --cp 2 --cp-attention ulysses || fail "CP 2, Ulysses"
expect_close cp2-ulysses one 5e-7
job cp2-tp2 4 -- --cp 2 --tp 2 --sequence-parallel || fail "CP 2 x TP 2 + SP"
expect_close cp2-tp2 one 5e-7
job cp2-fsdp2 4 -- --cp 2 --dp 2 --data-parallel fsdp || fail "CP 2 x FSDP 2"
expect_close cp2-fsdp2 one 5e-7
job pp2-cp2 4 -- --pp 2 --cp 2 --checkpoint-activations || fail "PP 2 x CP 2 with AC"
expect_close pp2-cp2 one 5e-7
job cp2-moe 8 -- "${moe[@]}" --cp 2 --dp 4 --ep 2 --steps 25 || fail "MoE, CP 2 x DP 4 (EP 2)"
expect_close cp2-moe moe-one 1e-6
job cp2-moe-fsdp 4 -- "${moe[@]}" --cp 2 --dp 2 --ep 2 --data-parallel fsdp --steps 25 || fail "MoE, CP 2 x FSDP 2 (EP 2)"
expect_close cp2-moe-fsdp moe-one 1e-6
cp -r ck/cp2-tp2 ck/cp-more
job cp-more 1 -- --resume --steps 25 || fail "resume of CP 2 x TP 2's checkpoint in one process"
grep -q "resumed from ck/cp-more at step 20 (written by 4 ranks" cp-more.log || fail "CP: no resume line"
expect_close cp-more one-25 1e-4
job bad-cp 2 -- --cp 2 --seq 18 && fail "--seq 18 over CP 2 ran"
grep -q "dtrain-llama: --seq 18 does not cut into the 4 chunks of --cp 2" bad-cp.log || fail "--seq 18 over CP 2: no error"
job bad-cp-dropout 2 -- --cp 2 --dropout 0.1 && fail "--dropout with CP ran"
grep -q "dtrain-llama: --dropout with --cp 2" bad-cp-dropout.log || fail "--dropout with CP: no error"
echo "CP: CP 2 (ring, Ulysses), CP 2 x TP 2 + SP, CP 2 x FSDP 2, PP 2 x CP 2 as one process; resumed in one process"

# DiLoCo (local_sgd.h): 2 replicas alone between syncs every 4 steps, in
# 2 fragments (layer 0 with the embedding, layer 1 with the head) synced at
# staggered steps, each average applied a step later, half of the
# replica's own values kept. With TP 2 inside each replica the losses agree
# within 1e-4; killed at step 12 (its step-10 checkpoint taken with fragment
# 0's average in flight), it resumes with steps 11-20 bitwise the
# uninterrupted run's.
sync=(--sync diloco --sync-every 4 --fragments 2 --sync-delay 1 --mixing 0.5)
job diloco 2 -- "${sync[@]}" || fail "DiLoCo, 2 replicas"
grep -q "dp 2 (diloco, sync every 4)" diloco.log || fail "DiLoCo: the layout line does not say diloco"
first=$(losses diloco | head -1 | awk '{print $2}') last=$(losses diloco | tail -1 | awk '{print $2}')
awk -v a="$first" -v b="$last" 'BEGIN {exit !(b < a - 0.5)}' || fail "DiLoCo: the loss did not fall ($first -> $last)"
job diloco-tp 4 -- "${sync[@]}" --tp 2 || fail "DiLoCo, 2 replicas of TP 2"
expect_close diloco-tp diloco 1e-4
job diloco-crash 2 --max-restarts 1 -- "${sync[@]}" --checkpoint-every 5 --crash-at-step 12 \
  || fail "DiLoCo killed at step 12 did not finish after its restart"
grep -q "resumed from ck/diloco-crash/replica-0 at step 10" diloco-crash.log || fail "DiLoCo: no resume at step 10"
[ "$(losses diloco-crash | awk '$1 > 10' | sort -n | uniq)" = "$(losses diloco | awk '$1 > 10')" ] \
  || fail "DiLoCo: the resumed run's losses are not the uninterrupted run's"
echo "DiLoCo killed at step 12, resumed from step 10: steps 11-20 bitwise the uninterrupted run's"
job bad-diloco 2 -- --sync diloco --data-parallel fsdp && fail "DiLoCo under FSDP ran"
grep -q "dtrain-llama: --sync diloco makes each data-parallel rank a replica of its own" bad-diloco.log \
  || fail "DiLoCo under FSDP: no error"

# Bad layouts.
job bad-tp 2 -- --tp 3 && fail "--tp 3 on 2 ranks ran"
grep -q "dtrain-llama: --tp 3 x --pp 1 does not divide the 2 ranks" bad-tp.log || fail "--tp 3: no error"
job bad-heads 2 -- --tp 2 --heads 3 --dim 30 && fail "3 heads over TP 2 ran"
grep -q "llama Attention: 3 heads do not split over a tensor-parallel group of 2 ranks" bad-heads.log \
  || fail "3 heads: no error"
echo "bad layouts named"
