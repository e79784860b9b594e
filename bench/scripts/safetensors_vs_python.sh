#!/usr/bin/env bash
# dtrain's safetensors against Hugging Face's library (python3-safetensors,
# in the Debian unstable root), through the Llama example:
#  1. PP 2 x FSDP 2 (4 ranks) trains 2 steps and exports its weights; the
#     file reads the same, bitwise, with safetensors.torch.load_file and
#     with the format read by hand;
#  2. each tensor is changed and written by safetensors.torch.save_file;
#     TP 2 (2 ranks) imports that and exports it again, untrained: bitwise
#     what save_file wrote;
#  3. the same two with mixture-of-experts layers: DP 2 x EP 2 exports one
#     tensor per expert under Hugging Face's names (experts.{e}.gate_proj.
#     weight ...), read alike by load_file and by hand; one process (every
#     expert) imports save_file's rewrite and exports it again bitwise.
# CI runs it in its Debian unstable leg.
# Usage: safetensors_vs_python.sh DTRAIN_RUN DTRAIN_LLAMA
set -euo pipefail
run=$(realpath "$1") llama=$(realpath "$2")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
tiny=(--dim 32 --layers 2 --heads 4 --hidden 64 --seq 16 --batch 8 --microbatches 2 --sample-bytes 0)
echo "safetensors: dtrain against safetensors $(python3 -c 'import safetensors; print(safetensors.__version__)')"
"$run" --standalone --nproc-per-node 4 "$llama" "${tiny[@]}" --steps 2 --pp 2 --dp 2 --data-parallel fsdp \
  --out-dir runs/a --checkpoint-dir ck/a --export-safetensors out-a > a.log 2>&1 || { tail -20 a.log; exit 1; }
python3 "$here/safetensors_vs_python.py" check out-a
python3 "$here/safetensors_vs_python.py" rewrite out-a in-b
"$run" --standalone --nproc-per-node 2 "$llama" "${tiny[@]}" --steps 0 --tp 2 --import-safetensors in-b \
  --out-dir runs/b --checkpoint-dir ck/b --export-safetensors out-b > b.log 2>&1 || { tail -20 b.log; exit 1; }
python3 "$here/safetensors_vs_python.py" same in-b out-b
moe=(--experts 4 --top-k 2 --shared-expert)
"$run" --standalone --nproc-per-node 2 "$llama" "${tiny[@]}" "${moe[@]}" --steps 2 --dp 2 --ep 2 \
  --out-dir runs/c --checkpoint-dir ck/c --export-safetensors out-c > c.log 2>&1 || { tail -20 c.log; exit 1; }
python3 "$here/safetensors_vs_python.py" check out-c
python3 "$here/safetensors_vs_python.py" experts out-c 2 4
python3 "$here/safetensors_vs_python.py" rewrite out-c in-d
"$run" --standalone --nproc-per-node 1 "$llama" "${tiny[@]}" "${moe[@]}" --steps 0 --import-safetensors in-d \
  --out-dir runs/d --checkpoint-dir ck/d --export-safetensors out-d > d.log 2>&1 || { tail -20 d.log; exit 1; }
python3 "$here/safetensors_vs_python.py" same in-d out-d
