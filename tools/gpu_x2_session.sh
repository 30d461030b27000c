#!/usr/bin/env bash
# The second H200 run of 2026-11-30 on the nvidia-h200-x2 kind, as one call (about 3 minutes):
# GPU 0 and GPU 1 run independent checks side by side, then both run the TP check, then the batch
# sweep and the async-scheduling cell side by side. Results (JSON lines and logs) under $OUT.
# Carry .whl/ (Hydra wheels); docs/benchmarks.md "Second run" records what it printed.
# Note: a device call returns at most 8 files from $OUT; tp/ holds more, its summary is printed.
R=${OUT:-$PWD/.out/x2}; mkdir -p "$R"
if [ ! -d /tmp/site/hydra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
B="python3 -m runtime.bench hal=cuda weights=random model=ouro-1.4b"
N="workloads.b128.new=32 workloads.b64.new=32 workloads.b32.new=32 workloads.b8.new=32"
(CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -m pytest tests/cuda/test_speculation_cuda.py -q -s -rs -p no:cacheprovider \
   -k "ouro_1_4b_shape and float32" >"$R/spec.txt" 2>&1; echo "spec rc=$? ${SECONDS}s" >>"$R/spec.txt") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 60 $B engine.kv_dtype=fp8 'workload=[b128]' $N output="$R/fp8.jsonl" >"$R/fp8.txt" 2>&1
 timeout 45 $B engine.kv_dtype=fp8 engine.weights_dtype=fp8 'workload=[b1]' workloads.b1.new=64 output="$R/fp8.jsonl" >>"$R/fp8.txt" 2>&1) &
wait; echo "phase1 ${SECONDS}s"; tail -3 "$R/spec.txt"; cat "$R/fp8.jsonl"
OUT=$R/tp TOTAL_S=165 bash tools/tp_check.sh >"$R/tp.txt" 2>&1; echo "tp ${SECONDS}s"; tail -25 "$R/tp.txt"
(CUDA_VISIBLE_DEVICES=0 timeout 120 $B engine.async_scheduling=true 'workload=[b128]' $N output="$R/async.jsonl" >"$R/async.txt" 2>&1
 CUDA_VISIBLE_DEVICES=0 timeout 100 $B 'workload=[b8,b32]' $N output="$R/sweep.jsonl" >>"$R/sweep.txt" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 200 $B engine.kv_mode=shared 'workload=[b8,b32,b64,b128]' $N output="$R/sweep.jsonl" >"$R/sweep1.txt" 2>&1) &
wait; echo "all ${SECONDS}s"; cat "$R/async.jsonl" "$R/sweep.jsonl"
