#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (the nvidia-h200-x2 kind), in one call of at most BUDGET_S (540) seconds:
#   1. TP=2 vs TP=1 greedy tokens at the Ouro-1.4B shape, random weights, bf16 and float32
#      (tools/tp_greedy.py: PASS, or where the tokens diverge and the TP=1 top-2 margin there);
#   2. runtime.bench decode at batch 1 and 64, TP=1 and TP=2 (torchrun), for Ouro-1.4B (4 loops) and
#      Huginn-0125 at 32 recurrences (55 heads: 28 + 27 per rank; batch 64 with 128-token prompts, as
#      1K prompts at 32 recurrences need ~200 GB of KV at TP=1). If the first TP=2 bench fails or hangs
#      with decode graphs (captured NCCL), the TP=2 runs go on with graphs=false, and the notes say so;
#   3. a table of decode ms/step, tok/s and the TP=2 speedup.
# Usage (Hydra and friends as .whl/*.whl or installed; NCCL_NVLS_ENABLE=0 etc. left as the machine sets them):
#   OUT=$OUT bash tools/tp_check.sh     # log.txt, notes.txt and bench.jsonl in $OUT (default .out/tp)
# A CPU dry run of the script itself (gloo, tiny models):
#   HAL=cpu GREEDY_MODEL=tests/data/golden/ouro-tiny/config.json GREEDY_DTYPES=float32 \
#   OURO="model=none model.path=tests/data/golden/ouro-tiny" HUGINN="model=none \
#   model.path=tests/data/golden/huginn-tiny" CELLS=[tiny] HUGINN_CELLS=[tiny] \
#   BENCH_EXTRA="matmul_size=64 dtype=float32" bash tools/tp_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out/tp}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then   # Hydra and friends, brought as wheels (as tools/gpu_check.sh does)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2)
HAL=${HAL:-cuda}
GREEDY_MODEL=${GREEDY_MODEL:-ouro-1.4b}
GREEDY_DTYPES=${GREEDY_DTYPES:-bfloat16 float32}
read -ra OURO <<<"${OURO:-model=ouro-1.4b}"
read -ra HUGINN <<<"${HUGINN:-model=huginn-0125 model.num_loops=32}"
read -ra BENCH_EXTRA <<<"${BENCH_EXTRA:-}"
CELLS=${CELLS:-[b1,b64]}
HUGINN_CELLS=${HUGINN_CELLS:-[b1,b64short]}
DEADLINE=$((SECONDS + ${BUDGET_S:-540}))
: >"$OUT/bench.jsonl"
: >"$OUT/notes.txt"
: >"$OUT/log.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | head -2
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count())'

run() {   # run LIMIT_S CMD...: the command's output goes to log.txt; within the overall deadline
  local limit=$1; shift
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt 30 ]; then echo "SKIPPED (time budget): $*" | tee -a "$OUT/notes.txt"; return 99; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== [$SECONDS s] $*" | tee -a "$OUT/log.txt"
  timeout -k 10 "$limit" "$@" >>"$OUT/log.txt" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && echo "   exit $rc after <= ${limit}s: $*" | tee -a "$OUT/log.txt" "$OUT/notes.txt"
  return $rc
}

# 1. greedy equality (the TP=2 engine runs with decode graphs where the Hal captures collectives)
for dtype in $GREEDY_DTYPES; do
  run 110 "${TORCHRUN[@]}" tools/tp_greedy.py --hal "$HAL" --model "$GREEDY_MODEL" --dtype "$dtype" \
    --num-prompts 8 --new 64
done
grep -a '^\[tp_greedy\]' "$OUT/log.txt"

# 2. benchmarks, one JSON row per cell appended to bench.jsonl
TP2_EXTRA=()
bench() {   # bench TP ARGS...
  local tp=$1; shift
  local args=(hal="$HAL" "$@" "${BENCH_EXTRA[@]}" output="$OUT/bench.jsonl")
  if [ "$tp" = 1 ]; then
    run 100 "$PY" -m runtime.bench "${args[@]}"
  elif ! run 120 "${TORCHRUN[@]}" -m runtime.bench "${args[@]}" parallel.tp=2 "${TP2_EXTRA[@]}"; then
    if [ ${#TP2_EXTRA[@]} -eq 0 ]; then
      echo "TP=2 bench failed with decode graphs ($*): the TP=2 runs go on with graphs=false" \
        | tee -a "$OUT/notes.txt"
      TP2_EXTRA=(graphs=false)
      run 100 "${TORCHRUN[@]}" -m runtime.bench "${args[@]}" parallel.tp=2 graphs=false
    fi
  fi
}
bench 1 "${OURO[@]}" "workload=$CELLS"
bench 2 "${OURO[@]}" "workload=$CELLS"
bench 1 "${HUGINN[@]}" "workload=$HUGINN_CELLS"
bench 2 "${HUGINN[@]}" "workload=$HUGINN_CELLS"

# 3. the table
"$PY" - "$OUT/bench.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
by = {(r["model"], r["loops"], r["workload"], r.get("tp", 1)): r for r in rows}
print(f"\n{'model':12s} {'loops':>5s} {'cell':9s} {'batch':>5s} {'tp':>3s} {'decode ms/step':>15s} "
      f"{'decode tok/s':>13s} {'prefill tok/s':>14s} {'peak GiB':>9s} {'vs TP=1':>8s}")
for (model, loops, cell, tp), r in sorted(by.items()):
    base = by.get((model, loops, cell, 1))
    speed = f"{base['decode_ms_step'] / r['decode_ms_step']:.2f}x" if base and tp != 1 else ""
    print(f"{model:12s} {loops:5d} {cell:9s} {r['batch']:5d} {tp:3d} {r['decode_ms_step']:15.3f} "
          f"{r['decode_tok_s']:13.1f} {r['prefill_tok_s']:14.1f} {r['peak_mem_gib']:9.2f} {speed:>8s}")
EOF
echo "notes:"; cat "$OUT/notes.txt"; echo "total ${SECONDS}s"
