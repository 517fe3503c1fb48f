#!/usr/bin/env bash
# qwen2.5-1.5b (make qwen15): one-shot `mla` at KV 0.5 (recipes/mla.yaml without its heal), compressed with
# --offload on WINDOWS (default 8) windows of 512 wiki calibration tokens (the recipe's 32 took ~4 min per layer on
# the shared, loaded 2-core box), then wiki perplexity of dense and compressed on the same fixed 2,048 tokens (4
# windows of 512 of the evaluation split), each command under /usr/bin/time -v (wall time, peak RSS).
# Writes benchmarks/results/qwen15/{compress,ppl-dense,ppl-mla}.{json,time}; OUT (default /tmp/attnslim-qwen15-mla50)
# holds the compressed model. Run from the repository root with the venv's attnslim on PATH.
set -euo pipefail
out=${OUT:-/tmp/attnslim-qwen15-mla50}
res=benchmarks/results/qwen15
mkdir -p "$res"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
run() {  # run NAME CMD...: stdout to NAME.json, time -v's report to NAME.time
  local name=$1; shift
  /usr/bin/time -v -o "$res/$name.time" "$@" > "$res/$name.json"
  grep -E "Elapsed|Maximum resident" "$res/$name.time"
}
run compress attnslim compress qwen2.5-1.5b --recipe mla --set heal=null --set calibration.windows=${WINDOWS:-8} --out "$out" --overwrite --offload --json
run ppl-dense attnslim eval qwen2.5-1.5b --data wiki --tokens 2048 --seq-len 512 --offload --json
run ppl-mla attnslim eval "$out" --data wiki --tokens 2048 --seq-len 512 --offload --json
