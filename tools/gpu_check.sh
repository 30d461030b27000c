#!/usr/bin/env bash
# The whole GPU check in one call on the NVIDIA machine: the cuda-marked tests, the conformance
# suite, the kernel benchmark, the engine benchmark cells and a profile of a decode step.
#   tools/gpu_check.sh [phase ...]     phases: conformance tests kernels bench models profile spec
#                                      specasync sweep fp8 cells peer profile64 train finetune spec22
#                                      fp8kernels fp8cells fp8quick fp8twin splits4 restcuda tune diag pdl slice slicediag
#                                      slicewide fp8b1 rowtune fp8prefill ncurow layout blas rows ab serve
#                                      (default: the first six)
# Logs go to $OUT/gpu_check.log, benchmark rows to $OUT/bench.jsonl; a short table is printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out/gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
BENCH="$OUT/bench.jsonl"
if [ -d /tmp/site/hydra ]; then          # installed already (several checks share one machine)
  export PYTHONPATH=/tmp/site:.
elif ls .whl/*.whl >/dev/null 2>&1; then   # Hydra and friends, brought as wheels (../shared/device/README.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
PHASES=${*:-conformance tests kernels bench models profile}
STATUS=()

run() {   # run NAME SECONDS CMD...: log everything, keep going on failure
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "===== $name: $*" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  STATUS+=("$(printf '%-34s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - start))")")
  tail -n 4 "$LOG"
}

bench() { run "bench $*" 300 python3 -m runtime.bench hal=cuda weights=random output="$BENCH" "$@"; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
for phase in $PHASES; do
  case $phase in
    train)   # issue 22: the packaged model (docs/ouro-tiny.md), from .out/tokens (examples/looped_data.py);
             # outputs come back as three shards and one tarball
      run train 500 python3 examples/train_looped.py --tokens .out/tokens --out /tmp/ouro-tiny \
        --report /tmp/ouro-tiny-report --device cuda --max-minutes 7.5 --reserve-seconds 45 --seq-len 512 \
        --batch-size 128 --hidden-size 512 --intermediate-size 1152 --num-layers 4 --num-heads 8 --num-loops 4 \
        --tie-embeddings --lr 1.5e-3 --warmup-steps 200 --entropy-weight 0.05 --entropy-weight-start 1.0 \
        --entropy-anneal 0.5 --eval-every 200 --eval-tokens 262144 --shard-mb 15 --no-progress --no-samples
      cp /tmp/ouro-tiny/*.safetensors "$OUT/" 2>/dev/null
      tar -C /tmp -czf "$OUT/ouro-tiny-rest.tgz" --exclude='*.safetensors' ouro-tiny ouro-tiny-report 2>/dev/null ;;
    finetune)   # issue 22: fine-tune the packaged ouro-tiny so that every loop pays (docs/ouro-tiny.md,
                # "Fine-tune"); $OUT/ft gets 3 weight shards, finetune.json, depth.png (tools/install_finetuned.py
                # installs them). FT_TOKENS: a token folder (looped_data.py --subset-of makes a small one);
                # FT_ARGS: more flags; FT_VARIANTS: several flag sets split by '|', run one after another, of
                # which $OUT/ft keeps the best by finetune_looped's selection rule ($OUT/ft-N.json the others' reports)
      IFS='|' read -r -a variants <<< "${FT_VARIANTS:-${FT_ARGS:-}}"
      [ ${#variants[@]} -gt 0 ] || variants=("")
      for i in "${!variants[@]}"; do
        run "finetune $i: ${variants[$i]}" 150 python3 examples/finetune_looped.py --init zoo/checkpoints/ouro-tiny \
          --tokens "${FT_TOKENS:-.out/tokens}" --out /tmp/ft-$i --weights-only --device cuda --max-seconds 125 \
          --throughput-batches 4 ${variants[$i]}
        grep -E '^(step|finetune|\{)' "$LOG" | tail -n 12
      done
      python3 tools/pick_finetuned.py --out "$OUT" /tmp/ft-* | tee -a "$LOG" ;;
    conformance) run conformance 300 python3 -m runtime.conformance hal=cuda ;;
    tests) run "pytest -m cuda" 590 python3 -m pytest tests -m cuda -q -rs -p no:cacheprovider ;;
    kernels) run "kernel bench" 240 python3 tools/kernel_bench.py ;;
    bench)
      bench model=ouro-1.4b 'workload=[b1,b64,b128,prefill8k]'
      bench model=ouro-1.4b engine.kv_mode=shared 'workload=[b128]' ;;
    pdl)     # programmatic dependent launch (hal/kernels/pdl.py): the chain microbenchmarks, then batch 1
             # with PDL off and on, for cuBLAS projections and for the decode GEMV (the Hal's opt-in)
      run "pdl chain" 240 python3 tools/pdl_bench.py --out "$OUT/pdl.jsonl"
      run "gemv_slice chain" 120 python3 tools/pdl_bench.py --quick --out "$OUT/pdl.jsonl"
      for proj in 0 1; do
        for on in 0 1; do
          LOOPSTACK_DECODE_PROJECTIONS=$proj LOOPSTACK_PDL=$on bench model=ouro-1.4b 'workload=[b1]'
        done
      done ;;
    slice)   # lever 37's default (hal/kernels/gemv_slice.py + PDL at one row) against cuBLAS in one call;
             # SLICE_SPLITS: also the models with K in at most that many slices (the table's split_k)
      for model in ouro-1.4b huginn-0125 nanbeige4.2-3b; do
        bench model=$model 'workload=[b1]'
        LOOPSTACK_DECODE_PROJECTIONS=0 bench model=$model 'workload=[b1]'
      done
      bench model=ouro-1.4b engine.kv_dtype=fp8 engine.weights_dtype=fp8 'workload=[b1]'
      bench model=ouro-1.4b 'workload=[b64,b128]'
      for model in huginn-0125 nanbeige4.2-3b; do
        [ -n "${SLICE_SPLITS:-}" ] && LOOPSTACK_KERNEL_CONFIGS="{\"gemv_slice\": [1, 4, 4, 1, 0, 0, 1, 2048, $SLICE_SPLITS]}" \
          bench model=$model 'workload=[b1]'
      done ;;
    slicediag)   # why several slices per row lost at Huginn's and Nanbeige's widths (lever 38): the chain
                 # of their four projections, cuBLAS against the slice kernel's configs, with and without PDL
      run "gemv_slice chain huginn" 150 python3 tools/pdl_bench.py --quick --model huginn-0125 --layers 8 \
        --out "$OUT/pdl.jsonl"
      run "gemv_slice chain nanbeige" 150 python3 tools/pdl_bench.py --quick --model nanbeige4.2-3b --layers 16 \
        --out "$OUT/pdl.jsonl" ;;
    slicewide)   # Nanbeige's K = 3072 in one slice of 4096 (a quarter masked) against cuBLAS, same call
      bench model=nanbeige4.2-3b 'workload=[b1]'
      for warps in 4 8; do
        LOOPSTACK_KERNEL_CONFIGS="{\"gemv_slice\": [1, 4, $warps, 1, 0, 0, 1, 4096, 3]}" \
          bench model=nanbeige4.2-3b 'workload=[b1]'
      done ;;
    models)
      bench model=huginn-0125 'workload=[b1]'
      bench model=nanbeige4.2-3b 'workload=[b1]' ;;
    serve)   # what runtime.serve's app adds to a decode step (tools/serve_host_cost.py): needs the serve extra's
             # wheels in .whl too (sh ../shared/device/wheels.sh fastapi uvicorn pydantic pydantic_core starlette
             # h11 anyio sniffio typing_extensions annotated_types typing_inspection idna click prometheus_client
             # httpx httpcore certifi opentelemetry-api importlib_metadata zipp)
      run "serve 64 x 1K" 150 python3 tools/serve_host_cost.py --hal cuda --full
      run "serve 1 x 128" 90 python3 tools/serve_host_cost.py --hal cuda --full --requests 1 --context 128 --tokens 256
      grep -E "driven directly|behind runtime.serve" "$LOG" | tail -n 4 ;;
    profile)
      run "profile b1" 90 python3 tools/profile_step.py --model ouro-1.4b --batch 1 --context 256 --rows 20 ;;
    profile64)
      run "profile b64" 90 python3 tools/profile_step.py --model ouro-1.4b --batch 64 --context 1024 --rows 25 ;;
    diag)    # where the device waits (timelines of the benchmark loop): the 8k prefill, decode at batch 1
      bench model=ouro-1.4b 'workload=[prefill8k]' profile_prefill=true
      bench model=ouro-1.4b 'workload=[b1]' profile=4
      bench model=huginn-0125 'workload=[b1]' profile=4
      bench model=nanbeige4.2-3b 'workload=[b1]' profile=4 ;;
    ab)      # a change against the code before it, alternating on one machine: `.old` holds the old tree
             # (mkdir .old && git archive <commit> hal runtime zoo conf pyproject.toml | tar -x -C .old);
             # the small cells a kernel or routing change moves, each new then old (rows of tree .NAME in
             # $OUT/bench-NAME.jsonl), twice for Ouro b1. AB_TREES=".old .mid" compares several trees;
             # AB_CELLS="cell;cell" replaces the cells
      trees=${AB_TREES:-.old}
      IFS=';' read -ra cells <<< "${AB_CELLS:-model=ouro-1.4b workload=[b1];model=ouro-1.4b workload=[b1];\
model=ouro-1.4b workload=[b1] engine.kv_dtype=fp8 engine.weights_dtype=fp8;model=huginn-0125 workload=[b1];\
model=nanbeige4.2-3b workload=[b1];model=ouro-1.4b workload=[b64]}"
      for cell in "${cells[@]}"; do
        bench $cell
        for tree in $trees; do
          [ -d "$tree/runtime" ] || { echo "ab: no $tree tree (see the comment)" | tee -a "$LOG"; continue; }
          run "$tree: $cell" 200 bash -c "cd $tree && exec python3 -m runtime.bench hal=cuda weights=random \
            output='$OUT/bench-${tree#.}.jsonl' $cell"
        done
      done ;;
    cells)   # the cells the issues quote: batch 1, 64 and 128 at the Ouro-1.4B shape; time to first token
      bench model=ouro-1.4b 'workload=[b1,b64,b128]' profile=4
      bench model=ouro-1.4b 'workload=[ttft1k,prefill8k,join128]' ;;
    spec22)  # issue 22: self-speculation on the packaged ouro-tiny (or the weights the finetune phase
             # just made), batch 1 and 8, draft depths 1..3 against off; token equality in float32
      model=zoo/checkpoints/ouro-tiny
      if ls "$OUT"/ft/*.safetensors >/dev/null 2>&1; then
        model=/tmp/ouro-tiny-ft; mkdir -p $model
        cp zoo/checkpoints/ouro-tiny/*.json $model/ && cp "$OUT"/ft/*.safetensors $model/
      fi
      echo "spec22 model: $model" | tee -a "$LOG"
      # a sync greedy round is one captured chain (draft passes + verify): golden tokens on the GPU first
      run "pytest speculation golden sync" 150 python3 -m pytest tests/cuda/test_speculation_cuda.py -q -rs -s \
        -p no:cacheprovider -k "golden and sync"
      for spec in "engine.speculative.num_tokens=0" "engine.speculative.num_tokens=4 engine.speculative.draft_loops=1" \
          "engine.speculative.num_tokens=4 engine.speculative.draft_loops=2" \
          "engine.speculative.num_tokens=4 engine.speculative.draft_loops=3" \
          "engine.speculative.num_tokens=4 engine.speculative.draft_loops=1 engine.speculative.fuse_round=false"; do
        bench weights=checkpoint model.path=$model model.dtype=bfloat16 'workload=[b1,b8s]' \
          '+workloads.b8s={batch:8,prompt:128,new:256}' $spec
      done
      run "spec_speedup float32" 150 python3 tools/spec_speedup.py --hal cuda --model $model --new 128 --dtype float32
      run "spec_speedup bf16" 150 python3 tools/spec_speedup.py --hal cuda --model $model --new 128 ;;
    decodekernels)   # issue 19: the decode projection kernels against cuBLAS and the floor
      run "decode kernels" 110 python3 tools/decode_kernels_bench.py --budget 90 --out "$OUT/decode_kernels.jsonl" ;;
    peer)    # the compiled gpt-fast-style decode (../shared/bench, copied to .peer): the bar to beat
      MODES=${PEER_MODES:-default} run "compiled peer" 240 python3 .peer/compiled_ouro.py zoo/configs/ouro-1.4b.json \
        1:256 64:1024 128:1024
      grep '^{' "$LOG" | grep '"mode"' > "$OUT/peer.jsonl" ;;
    specasync)   # sync and async speculation equal plain decoding at the Ouro-1.4B shape (float32)
      run "speculation equality" 180 python3 -m pytest tests/cuda/test_speculation_cuda.py -q -s -rs \
        -p no:cacheprovider -k "ouro_1_4b_shape and float32" ;;
    sweep)   # tok/s against batch, full and shared KV (docs/throughput.png); 32 new tokens per request suffice
      for kv in ${SWEEP_KV:-full shared}; do
        bench model=ouro-1.4b engine.kv_mode=$kv 'workload=[b1,b8,b32,b64,b128]' workloads.b1.new=64 \
          workloads.b8.new=32 workloads.b32.new=32 workloads.b64.new=32 workloads.b128.new=32
      done ;;
    spec) bench model=ouro-1.4b 'workload=[b1,b8,b32]' engine.speculative.num_tokens=4 engine.speculative.draft_loops=2 ;;
    fp8)   # issue 14: FP8 KV and FP8 weights (docs/fp8.md); bf16 rows come from the bench phase
      run "pytest fp8" 240 python3 -m pytest tests/cuda/test_fp8_cuda.py -q -rs -s -p no:cacheprovider
      bench model=ouro-1.4b engine.kv_dtype=fp8 'workload=[b1,b64,b128,prefill8k]'
      bench model=ouro-1.4b engine.kv_dtype=fp8 engine.kv_mode=shared 'workload=[b128]'
      bench model=ouro-1.4b engine.weights_dtype=fp8 'workload=[b1]'
      bench model=ouro-1.4b engine.kv_dtype=fp8 engine.weights_dtype=fp8 'workload=[b1]'
      LOOPSTACK_FP8_GEMM=triton bench model=ouro-1.4b engine.weights_dtype=fp8 'workload=[b1]' ;;
    fp8kernels)   # issue 20: the FP8 kernels against their bf16 twins (tools/fp8_kernels_bench.py)
      run "fp8 kernels" 200 python3 tools/fp8_kernels_bench.py --budget 150 --out "$OUT/fp8_kernels.jsonl" ;;
    tune)     # decode attention: sweep the unified and the row-stream kernels (tools/fp8_kernels_bench.py),
              # pick the best for batch 64 + 128 (tools/pick_decode_configs.py), then the cuda attention
              # tests and the decode cells with the pick (LOOPSTACK_KERNEL_CONFIGS)
      run "attention sweep" 230 python3 tools/fp8_kernels_bench.py --only attn --budget 200 --out "$OUT/attn_sweep.jsonl"
      grep -E "B(64|128)xK1024" "$LOG" | grep -E " rows | \(table" | tail -n 40
      LOOPSTACK_KERNEL_CONFIGS=$(python3 tools/pick_decode_configs.py "$OUT/attn_sweep.jsonl" 2>>"$LOG")
      export LOOPSTACK_KERNEL_CONFIGS
      echo "picked: $LOOPSTACK_KERNEL_CONFIGS" | tee -a "$LOG"
      run "pytest fp8 (pick)" 120 python3 -m pytest tests/cuda/test_fp8_cuda.py -q -rs -p no:cacheprovider
      bench model=ouro-1.4b 'workload=[b64,b128]'
      bench model=ouro-1.4b engine.kv_dtype=fp8 'workload=[b64,b128]' ;;
    rowtune)  # the row-stream decode kernel's sweep at batch 64 and 128 (tools/fp8_kernels_bench.py), then the
              # pick (tools/pick_decode_configs.py) exported for the phases after it in this call
      run "row kernel sweep" 150 python3 tools/fp8_kernels_bench.py --only attnrows --budget 120 --out "$OUT/row_sweep.jsonl"
      grep -E "B(64|128)xK1024" "$LOG" | grep -E " rows |\(table" | tail -n 30
      LOOPSTACK_KERNEL_CONFIGS=$(python3 tools/pick_decode_configs.py "$OUT/row_sweep.jsonl" 2>>"$LOG")
      export LOOPSTACK_KERNEL_CONFIGS
      echo "picked: $LOOPSTACK_KERNEL_CONFIGS" | tee -a "$LOG" ;;
    layout)   # lever 49: the row kernel over other cache layouts (one head per slot row; bf16 at head dim 64)
      run "layout diagnostic" 150 python3 tools/fp8_kernels_bench.py --only layout --budget 120 --out "$OUT/layout.jsonl" ;;
    blas)     # the projections' library paths at b64 and the 8k prefill, in this order: cuBLAS (torch's
              # default), cuBLASLt (TORCH_BLAS_PREFER_CUBLASLT), TunableOp (every cuBLAS/cuBLASLt algorithm
              # timed per shape in the eager warm-up before capture; the picks to $OUT/tunableop.csv)
      echo "----- blas: default" | tee -a "$LOG"
      bench model=ouro-1.4b 'workload=[b64,prefill8k]'
      echo "----- blas: TORCH_BLAS_PREFER_CUBLASLT=1" | tee -a "$LOG"
      TORCH_BLAS_PREFER_CUBLASLT=1 bench model=ouro-1.4b 'workload=[b64,prefill8k]'
      echo "----- blas: PYTORCH_TUNABLEOP_ENABLED=1" | tee -a "$LOG"
      PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_FILENAME="$OUT/tunableop.csv" \
        bench model=ouro-1.4b 'workload=[b64,prefill8k]' ;;
    ncurow)   # Nsight Compute on the row decode kernel at 128 x 1K (tools/row_decode_ncu.py): FP8, bf16, bf16 D64
      run "ncu row decode" 240 ncu --clock-control none -k regex:_row_decode_kernel -s 2 -c 7 --metrics \
gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,\
smsp__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,\
smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,\
smsp__average_warp_latency_issue_stalled_not_selected.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,\
smsp__average_warp_latency_issue_stalled_wait.ratio,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,\
lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,smsp__warps_eligible.avg.per_cycle_active \
        python3 tools/row_decode_ncu.py
      grep -E "_row_decode_kernel|gpu__time|dram__|issue_active|warps_|pipe_|stalled|hit_rate|lts__t_" "$LOG" | tail -n 120 ;;
    fp8prefill)   # issue 20: the 8k prefill over an FP8 cache beside bf16, same call
      bench model=ouro-1.4b 'workload=[prefill8k]'
      bench model=ouro-1.4b engine.kv_dtype=fp8 'workload=[prefill8k]' ;;
    fp8b1)        # issue 20's batch-1 cells with FP8 weights beside bf16, same call
      bench model=ouro-1.4b 'workload=[b1]'
      bench model=ouro-1.4b engine.kv_dtype=fp8 engine.weights_dtype=fp8 'workload=[b1]'
      bench model=ouro-1.4b engine.weights_dtype=fp8 'workload=[b1]' ;;
    fp8twin)      # issue 20's last FP8 cells behind bf16 (batch 1 of many heads: 0.992-0.996x, docs/fp8.md):
                  # each kernel's own time, PDL off (with it a kernel's wait for the one before counts as its time)
      for model in nanbeige4.2-3b huginn-0125; do
        LOOPSTACK_PDL=0 bench model=$model 'workload=[b1]' profile=4
        LOOPSTACK_PDL=0 bench model=$model engine.kv_dtype=fp8 'workload=[b1]' profile=4
      done ;;
    splits4)      # batch 1 of the many-head models with at most 4 context splits (8 by the rule,
                  # hal/kernels/splits.py) against the rule, FP8 KV too: lever 57 measured 16 -> 8 only
      for model in nanbeige4.2-3b huginn-0125; do
        for kv in auto fp8; do
          bench model=$model engine.kv_dtype=$kv 'workload=[b1]'
          LOOPSTACK_MAX_SPLITS=4 bench model=$model engine.kv_dtype=$kv 'workload=[b1]'
        done
      done ;;
    fp8quick)     # issue 20's decode cells only (their bf16 twins come from the cells phase of the same call)
      bench model=ouro-1.4b engine.kv_dtype=fp8 'workload=[b1,b64,b128]'
      bench model=ouro-1.4b engine.kv_dtype=fp8 engine.weights_dtype=fp8 'workload=[b1]' ;;
    restcuda)     # the cuda-marked tests the kernel phases do not cover (scheduling, speculation)
      run "pytest scheduling+speculation" 240 python3 -m pytest tests/cuda/test_scheduling_cuda.py \
        tests/cuda/test_speculation_cuda.py -q -rs -p no:cacheprovider ;;
    fp8cells)     # issue 20: the acceptance cells, FP8 and bf16 in one call
      run "pytest fp8" 240 python3 -m pytest tests/cuda/test_fp8_cuda.py -q -rs -p no:cacheprovider
      bench model=ouro-1.4b 'workload=[b1,b128,prefill8k]'
      bench model=ouro-1.4b engine.kv_dtype=fp8 'workload=[b1,b128,prefill8k]'
      bench model=ouro-1.4b engine.kv_dtype=fp8 engine.weights_dtype=fp8 'workload=[b1]'
      bench model=ouro-1.4b engine.weights_dtype=fp8 'workload=[b1]' ;;
    rows)     # lever 53: gemv.py's tl.dot path at 64 rows against cuBLAS (tools/pdl_bench.py --rows): the
              # layer chain of Ouro-1.4B's projections, each config without PDL, with it, and with the first
              # weight tile before the wait; the b64 cell on cuBLAS and with the chain's fastest
              # preloading config as the gemv_wide entry; each projection alone; Nsight Compute on o and down
      run "rows64 chain" 300 python3 tools/pdl_bench.py --rows 64 --out "$OUT/rows.jsonl"
      bench model=ouro-1.4b 'workload=[b64]'
      python3 - "$OUT/rows.jsonl" > "$OUT/wide_picks.txt" <<'PY'
import json, re, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
chain = sorted((r for r in rows if r["shape"] == "chain" and r["variant"].endswith("pdl preload")),
               key=lambda r: r["us_per_layer"])
for r in chain[:1]:
    bn, bk, w, s, sk = map(int, re.search(r"n(\d+) k(\d+) w(\d+) s(\d+) sk(\d+)", r["variant"]).groups())
    print(json.dumps({"gemv_wide": [16, bn, w, s, 0, 0, 1, bk, sk]}))
PY
      while read -r cfg; do
        echo "----- gemv_wide $cfg" | tee -a "$LOG"
        LOOPSTACK_KERNEL_CONFIGS="$cfg" bench model=ouro-1.4b 'workload=[b64]' profile=4
      done < "$OUT/wide_picks.txt"
      for shape in o down qkv gate_up; do
        run "rows64 $shape" 100 python3 tools/pdl_bench.py --rows 64 --shape $shape --out "$OUT/rows.jsonl"
      done
      grep -E "us/layer" "$LOG" | tail -n 120
      run "ncu rows" 120 ncu --clock-control none --metrics \
gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,launch__grid_size,\
launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers,\
launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active,\
smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,\
smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,\
smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,\
smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,\
lts__t_bytes.sum,sm__cycles_active.avg \
        python3 tools/rows_gemm_ncu.py
      grep -E "^  [a-zA-Z_]|gpu__time|dram__|launch__|warps_|issue_active|stalled|lts__t|cycles_active" "$LOG" | tail -n 400 > "$OUT/ncu_rows.txt" ;;
    *) echo "unknown phase $phase" ;;
  esac
done

echo "===== summary" | tee -a "$LOG"
printf '%s\n' "${STATUS[@]}" | tee -a "$LOG"
if [ -f "$BENCH" ]; then
  python3 - "$BENCH" <<'EOF' | tee -a "$LOG"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
keys = ["model", "workload", "kv_mode", "kv_dtype", "weights_dtype", "spec", "batch", "prefill_tok_s", "decode_ms_step", "decode_tok_s",
        "decode_floor_ms", "decode_vs_floor", "prefill_vs_floor", "speedup_vs_hf", "acceptance_rate", "peak_mem_gib"]
print(" | ".join(keys))
for r in rows:
    print(" | ".join(str(r.get(k, "")) for k in keys))
EOF
fi
