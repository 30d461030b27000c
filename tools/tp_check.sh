#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (the nvidia-h200-x2 kind) in one call, about 2-4 minutes:
#   TP=2 vs TP=1 greedy at the Ouro-1.4B shape (random bf16 weights), the decode benchmark at batch
#   1 and 64 (Ouro-1.4B) and batch 1 (Huginn-0125, 32 recurrences) at TP=1 and TP=2, then if time
#   allows the greedy check in float32 and the golden cases through runtime.generate at parallel.tp=2;
#   one torchrun launch of tools/tp_check.py (its docstring says what each phase does). If that launch
#   fails before the TP=2 benchmark rows exist (a collective that decode graphs cannot capture, say),
#   it runs once more with engine.graphs=false.
# Usage (Hydra, OmegaConf and antlr4 as .whl/*.whl, see ../shared/device/README.md):
#   bash tools/tp_check.sh                # results in $OUT (default .out/tp): log.txt, greedy.jsonl, bench.jsonl
# A CPU dry run of the whole script (gloo, the golden tiny configs):
#   HAL=cpu bash tools/tp_check.sh --ouro tests/data/golden/ouro-tiny --huginn tests/data/golden/huginn-tiny \
#     --huginn-loops 4 --cells b1:1x16+8,b4:4x16+8 --huginn-cells b1:1x16+8 --prompts 2 --prompt-len 8 \
#     --new 8 --matmul-size 64
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out/tp}
mkdir -p "$OUT"
rm -f "$OUT/bench.jsonl" "$OUT/greedy.jsonl" "$OUT/log.txt"
PY=${PYTHON:-python3}
if [ -d /tmp/site/hydra ]; then
  export PYTHONPATH=/tmp/site
elif ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
# NVLink multicast stays off on the shared hosts (KINDS.md): keep it so in the ranks' environment
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$PY" -c 'import hydra, omegaconf' 2>/dev/null \
  || { echo "Hydra is missing: carry .whl/ (sh ../shared/device/wheels.sh fills it)"; exit 2; }
HAL=${HAL:-cuda}
if [ "$HAL" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  "$PY" -c 'import torch; print("torch", torch.__version__, "devices", torch.cuda.device_count())'
fi
TOTAL_S=${TOTAL_S:-300}         # hard cap for both launches together

launch() {   # launch LIMIT_S ARGS...: one torchrun of tp_check.py; progress lines shown, all in log.txt
  local limit=$1; shift
  echo "== [${SECONDS}s] tp_check.py --hal $HAL $*"
  timeout -k 15 "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 tools/tp_check.py \
    --hal "$HAL" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/log.txt" \
    | grep --line-buffered -E '^\[tp_check|Error|error:|Timeout|Traceback|File "/'
  return "${PIPESTATUS[0]}"
}

launch "$((TOTAL_S - 70))" "$@"
rc=$?
if [ $rc -ne 0 ]; then
  echo "first launch exit $rc after ${SECONDS}s; last lines of $OUT/log.txt:"
  tail -n 25 "$OUT/log.txt"
  left=$((TOTAL_S - SECONDS))
  if ! grep -q '"tp": 2' "$OUT/bench.jsonl" 2>/dev/null && [ "$left" -ge 100 ]; then
    echo "== again with engine.graphs=false (TP=1 benchmark rows already there are kept)"
    launch "$left" --graphs false --fp32 no --golden no "$@"
    rc=$?
  fi
fi
"$PY" tools/tp_check.py --table "$OUT"
echo "total ${SECONDS}s, exit $rc"
exit $rc
