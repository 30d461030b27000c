#!/usr/bin/env bash
# Issues 18-20's acceptance cells in one device call, the compiled peer in the same call (ratios in one
# run), then the cuda engine tests and lever 122's rows, each step only if the call's budget still holds it.
#   END=560 [PARTS="cells tests gaps fp8prefill fp8rows fp8kvprefill prefilltiles fp8tests ab s54 s54b s55 s56
#                   s57 s58 s59 s60 s61 s62 s63 s64 s66 ring rows configs huginn profile profile_batches
#                   landed tcrows smallbatch"] \
#     bash tools/acceptance_call.sh
# END: seconds this script may use (the run's limit less a margin); PARTS: which parts, in order (default by
# GPU; H200_PARTS and OTHER_PARTS set them for one kind of card only).
# Files under $OUT (at most seven of the 8 a call brings back): rows.jsonl (runtime.bench), peer.txt, pytest.txt,
# ring_rows.jsonl and ring.json (tools/ring_sweep.py of RING_MODEL, default nanbeige4.2-3b), fp8_prompt.jsonl
# (fp8rows), acceptance.log; a table last.
# On an H100 the tests go first (its numbers are not the issues' targets), then lever 121's configs, then the cells.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out/acceptance}
END=${END:-560}
mkdir -p "$OUT"
LOG=$OUT/acceptance.log
ROWS=$OUT/rows.jsonl
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/hydra ]; then   # Hydra as wheels (../shared/device/README.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
STATUS=()

step() {   # step NAME COST LIMIT CMD...: skip when COST seconds no longer fit before END; cap at LIMIT
  local name=$1 cost=$2 limit=$3; shift 3
  if (( SECONDS + cost > END )); then STATUS+=("$(printf '%-40s skipped (budget)' "$name")"); return; fi
  (( limit > END - SECONDS )) && limit=$(( END - SECONDS ))
  local start=$SECONDS
  echo "===== $name: $*" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  STATUS+=("$(printf '%-40s rc=%-3s %4ss' "$name" "$?" "$((SECONDS - start))")")
}
bench() { local name=$1; shift; step "$name" 35 150 python3 -m runtime.bench hal=${HAL:-cuda} weights=random output="$ROWS" "$@"; }
OLD=${OLD:-.old}    # the tree before, where a part compares against it (`git archive <commit>` carried in)
old_bench() {       # bench in $OLD's tree, if carried
  [ -d "$OLD" ] || return 0
  pushd "$OLD" > /dev/null && bench "$@"
  popd > /dev/null
}
FP8=(engine.kv_dtype=fp8 engine.weights_dtype=fp8)
T128='+workloads.t128={batch:1,prompt:128,new:16,repeats:5}'    # a 128-token prompt's first token (median)
ONE_ROW='{"gemv_slice_w8a8": [1, 128, 8, 1, 0, 0, 1, 512, 48]}'   # the W8A8 entry before lever 122

cells() {
  bench "ouro b1 bf16" model=ouro-1.4b 'workload=[b1]'
  bench "ouro b1 fp8" model=ouro-1.4b "${FP8[@]}" 'workload=[b1]'
  step "peer" 70 200 bash -c "MODES=${PEER_MODES:-default} python3 .peer/compiled_ouro.py zoo/configs/ouro-1.4b.json 1:256 64:1024 128:1024 > $OUT/peer.txt 2>&1"
  bench "nanbeige b1 bf16" model=nanbeige4.2-3b 'workload=[b1]'
  bench "nanbeige b1 fp8" model=nanbeige4.2-3b "${FP8[@]}" 'workload=[b1]'
  bench "huginn b1" model=huginn-0125 'workload=[b1]'
  bench "ouro b64 b128" model=ouro-1.4b 'workload=[b64,b128]'
  bench "ouro b128 fp8 kv" model=ouro-1.4b engine.kv_dtype=fp8 'workload=[b128]'
  bench "ouro ttft1k prefill8k" model=ouro-1.4b 'workload=[ttft1k,prefill8k]'
  bench "ouro b1 bf16 (again)" model=ouro-1.4b 'workload=[b1]'
  bench "ouro b1 fp8 (again)" model=ouro-1.4b "${FP8[@]}" 'workload=[b1]'
}
tests() {
  step "pytest engine" 90 240 bash -c "python3 -m pytest -m cuda tests/cuda/test_engine_cuda.py -q -rs -p no:cacheprovider \
    >> $OUT/pytest.txt 2>&1"
  step "pytest rows (lever 122)" 40 120 bash -c "python3 -m pytest -m cuda tests/cuda/test_fp8_cuda.py \
    tests/cuda/test_decode_kernels_cuda.py -k 'w8a8_slice or tensor_core_slice' -q -rs -p no:cacheprovider >> $OUT/pytest.txt 2>&1"
  step "pytest ring" 40 120 bash -c "python3 -m pytest -m cuda tests/cuda/test_ring_gemv_cuda.py -q -rs \
    -p no:cacheprovider >> $OUT/pytest.txt 2>&1"
}
gaps() {   # the cuda tests the tests part leaves out (speculation, FP8 whole, scheduling, graphs, fresh prefill,
          # cuBLASLt, the Hal's device tests with conformance R3)
  step "pytest the rest" 120 330 bash -c "python3 -m pytest -m cuda tests/cuda tests/hal -q -rs -p no:cacheprovider \
    --ignore tests/cuda/test_engine_cuda.py --ignore tests/cuda/test_ring_gemv_cuda.py >> $OUT/pytest.txt 2>&1"
}
fp8prefill() {   # lever 128: time to first token and prefill with FP8 against bf16 (128, 1K and 8K-token
                 # prompts), the W8A16 Triton GEMM forced, and the 128-token prefill under the profiler
  local cells='workload=[t128,ttft1k,prefill8k]'
  bench "prefill bf16" model=ouro-1.4b "$T128" "$cells"
  bench "prefill fp8 kv" model=ouro-1.4b engine.kv_dtype=fp8 "$T128" "$cells"
  bench "prefill fp8 w+kv" model=ouro-1.4b "${FP8[@]}" "$T128" "$cells"
  bench "prefill bf16 profiled" model=ouro-1.4b "$T128" 'workload=[t128]' profile_prefill=true
  bench "prefill fp8 w+kv profiled" model=ouro-1.4b "${FP8[@]}" "$T128" 'workload=[t128]' profile_prefill=true
  LOOPSTACK_FP8_GEMM=triton bench "prefill fp8 w+kv triton gemm" model=ouro-1.4b "${FP8[@]}" "$T128" \
    'workload=[t128,ttft1k]'
}
fp8rows() {   # lever 134 (probe): a prompt's FP8 products on rows already quantized, _scaled_mm against the tile
              # kernel's W8A8 form, beside _scaled_mm with its quantization and cuBLAS bf16, one product at a time
  step "fp8 prompt products" 60 260 python3 tools/fp8_kernels_bench.py --only prompt --budget 230 \
    --out "$OUT/fp8_prompt.jsonl"
}
fp8kvprefill() {   # lever 130: prompts over an FP8 cache with the paged prefill kernel in spill-free tiles,
                   # against the table's tile then (it spilled) and bf16, and the 1,024-token prompt profiled
  local config cells='workload=[t128,ttft1k]'
  bench "kv bf16 prompts" model=ouro-1.4b "$T128" "$cells"
  bench "kv fp8 prompts" model=ouro-1.4b engine.kv_dtype=fp8 "$T128" "$cells"
  for config in "128, 32, 8, 3" "64, 64, 4, 3" "64, 32, 4, 3"; do
    LOOPSTACK_KERNEL_CONFIGS="{\"attention_prefill_fp8\": [$config]}" bench "kv fp8 prompts [$config]" \
      model=ouro-1.4b engine.kv_dtype=fp8 "$T128" "$cells"
  done
  bench "kv fp8 prompts (again)" model=ouro-1.4b engine.kv_dtype=fp8 "$T128" "$cells"
  bench "kv bf16 ttft1k profiled" model=ouro-1.4b 'workload=[ttft1k]' profile_prefill=true
  bench "kv fp8 ttft1k profiled" model=ouro-1.4b engine.kv_dtype=fp8 'workload=[ttft1k]' profile_prefill=true
}
prefilltiles() {   # lever 130 again: the 64 x 64 prefill tile over an FP8 cache against the table's then,
                   # alternating, the same tile for bf16, and a 16K prompt (its second chunk attends over 8K)
  local round cells='workload=[t128,ttft1k]' tile='[64, 64, 4, 3]'
  local p16k='+workloads.p16k={batch:1,prompt:16384,new:1}'
  for round in 1 2; do
    bench "kv fp8 prompts ($round)" model=ouro-1.4b engine.kv_dtype=fp8 "$T128" "$cells"
    LOOPSTACK_KERNEL_CONFIGS="{\"attention_prefill_fp8\": $tile}" bench "kv fp8 prompts 64x64 ($round)" \
      model=ouro-1.4b engine.kv_dtype=fp8 "$T128" "$cells"
  done
  bench "bf16 prompts" model=ouro-1.4b "$T128" "$cells"
  LOOPSTACK_KERNEL_CONFIGS="{\"attention_prefill\": $tile}" bench "bf16 prompts 64x64" model=ouro-1.4b "$T128" \
    "$cells"
  bench "kv fp8 16k" model=ouro-1.4b engine.kv_dtype=fp8 "$p16k" 'workload=[p16k]'
  LOOPSTACK_KERNEL_CONFIGS="{\"attention_prefill_fp8\": $tile}" bench "kv fp8 16k 64x64" model=ouro-1.4b \
    engine.kv_dtype=fp8 "$p16k" 'workload=[p16k]'
}
fp8tests() {   # lever 130 as landed: the FP8 cuda tests and the engine's with an FP8 cache, then its prompts
  step "pytest fp8" 60 150 bash -c "python3 -m pytest -m cuda tests/cuda/test_fp8_cuda.py \
    tests/cuda/test_engine_cuda.py -k 'fp8' -q -rs -p no:cacheprovider >> $OUT/pytest.txt 2>&1"
  bench "kv fp8 prompts (table)" model=ouro-1.4b engine.kv_dtype=fp8 "$T128" 'workload=[t128,ttft1k]'
}
ab() {   # this tree against the ones in AB_TREES (default .old; each `git archive <commit> | tar -x -C DIR`,
         # carried), alternating twice, each running runtime.bench with AB_ARGS (default: the FP8 prompts)
  local round tree args=(model=ouro-1.4b "${FP8[@]}" "$T128" 'workload=[t128,ttft1k,prefill8k]')
  [ -n "${AB_ARGS:-}" ] && read -ra args <<< "$AB_ARGS"
  for round in 1 2; do
    bench "ab new ($round)" "${args[@]}"
    for tree in ${AB_TREES:-.old}; do
      if [ ! -d "$tree" ]; then STATUS+=("ab: no $tree tree (carry it)"); continue; fi
      pushd "$tree" > /dev/null && bench "ab $tree ($round)" "${args[@]}"
      popd > /dev/null
    done
  done
}
s54() {   # levers 131-132 (FP8 prompts' activation quantizations fused) against the trees before each (.old131:
          # before 132; .old: before 131), bf16 in the same rounds; bf16 b1 against .old131 (the norm boundary
          # kernels now compile without contraction); the FP8 128-token prefill profiled
  local round tree cells='workload=[t128,ttft1k,prefill8k]'
  for round in 1 2; do
    bench "bf16 prompts ($round)" model=ouro-1.4b "$T128" "$cells"
    bench "fp8 prompts ($round)" model=ouro-1.4b "${FP8[@]}" "$T128" "$cells"
    for tree in .old131 .old; do
      [ -d "$tree" ] || continue
      pushd "$tree" > /dev/null && bench "fp8 prompts $tree ($round)" model=ouro-1.4b "${FP8[@]}" "$T128" "$cells"
      popd > /dev/null
    done
  done
  bench "b1 bf16" model=ouro-1.4b 'workload=[b1]'
  if [ -d .old131 ]; then
    pushd .old131 > /dev/null && bench "b1 bf16 .old131" model=ouro-1.4b 'workload=[b1]'
    popd > /dev/null
  fi
  bench "fp8 w+kv t128 profiled" model=ouro-1.4b "${FP8[@]}" "$T128" 'workload=[t128]' profile_prefill=true
}
s54b() {  # lever 133: the fused SwiGLU quantization with the sm_90 table's 16 warps against the rms_norm entry's
          # 4 (the optional entry removed), alternating, FP8 prompts; bf16 prompts once; the FP8 prefill profiled
  local round cells='workload=[t128,ttft1k,prefill8k]'
  for round in 1 2; do
    bench "fp8 prompts 16 warps ($round)" model=ouro-1.4b "${FP8[@]}" "$T128" "$cells"
    LOOPSTACK_KERNEL_CONFIGS='{"silu_mul_quantize_rows": null}' bench "fp8 prompts 4 warps ($round)" \
      model=ouro-1.4b "${FP8[@]}" "$T128" "$cells"
  done
  bench "bf16 prompts" model=ouro-1.4b "$T128" "$cells"
  bench "fp8 w+kv t128 profiled" model=ouro-1.4b "${FP8[@]}" "$T128" 'workload=[t128]' profile_prefill=true
}
rows() {   # lever 122: FP8 weights + KV at b8 on the table's 16-row W8A8 entry and on the one-row entry it replaced
  bench "b8 fp8" model=ouro-1.4b "${FP8[@]}" 'workload=[b8]'
  LOOPSTACK_KERNEL_CONFIGS=$ONE_ROW bench "b8 fp8 one-row entry" model=ouro-1.4b "${FP8[@]}" 'workload=[b8]'
}
configs() {   # lever 121: other W8A8 slice configs as the one-row entry, FP8 weights + KV at b1
  local entry
  for entry in "64, 4, 1, 0, 0, 1, 512" "128, 4, 1, 0, 0, 1, 256" "256, 8, 1, 0, 0, 1, 256"; do
    local configs="{\"gemv_slice_w8a8\": [1, $entry, 32]}"
    LOOPSTACK_KERNEL_CONFIGS=$configs bench "ouro b1 fp8 w8a8 [$entry]" model=ouro-1.4b "${FP8[@]}" 'workload=[b1]'
    LOOPSTACK_KERNEL_CONFIGS=$configs bench "nanbeige b1 fp8 w8a8 [$entry]" model=nanbeige4.2-3b "${FP8[@]}" \
      'workload=[b1]'
  done
}
huginn() {   # lever 124: Huginn-0125's FP8 down (K = 17,920: 35 slices of 512) on the W8A8 entry (split_k 48,
             # the table's since the fifty-first session) against split_k 32 (down off it), and its bf16 twin
  bench "huginn b1 fp8" model=huginn-0125 "${FP8[@]}" 'workload=[b1]'
  LOOPSTACK_KERNEL_CONFIGS='{"gemv_slice_w8a8": [1, 128, 8, 1, 0, 0, 1, 512, 32]}' \
    bench "huginn b1 fp8 split_k 32" model=huginn-0125 "${FP8[@]}" 'workload=[b1]'
  bench "huginn b1 bf16" model=huginn-0125 'workload=[b1]'
}
s55() {   # lever 135: an FP8 cache's prompts without context on the 16-bit tile over their own K/V,
          # against .old (the tree before), alternating twice, bf16 in the same rounds; FP8 weights + KV
          # on both trees; the FP8 KV 1,024-token prefill profiled
  local round cells='workload=[t128,ttft1k]'
  for round in 1 2; do
    bench "kv fp8 prompts ($round)" model=ouro-1.4b engine.kv_dtype=fp8 "$T128" "$cells"
    if [ -d .old ]; then
      pushd .old > /dev/null && bench "kv fp8 prompts .old ($round)" model=ouro-1.4b engine.kv_dtype=fp8 \
        "$T128" "$cells"
      popd > /dev/null
    fi
    bench "bf16 prompts ($round)" model=ouro-1.4b "$T128" "$cells"
  done
  bench "fp8 w+kv prompts" model=ouro-1.4b "${FP8[@]}" "$T128" "$cells"
  if [ -d .old ]; then
    pushd .old > /dev/null && bench "fp8 w+kv prompts .old" model=ouro-1.4b "${FP8[@]}" "$T128" "$cells"
    popd > /dev/null
  fi
  bench "kv fp8 ttft1k profiled" model=ouro-1.4b engine.kv_dtype=fp8 'workload=[ttft1k]' profile_prefill=true
}
s56() {   # lever 136: a 16-bit cache's prompts without context over their own K/V, against .old (lever 135
          # alone), alternating twice; FP8 KV prompts once; its GPU test; the bf16 1,024-token prefill profiled
  local round cells='workload=[t128,ttft1k]'
  for round in 1 2; do
    bench "bf16 prompts ($round)" model=ouro-1.4b "$T128" "$cells"
    if [ -d .old ]; then
      pushd .old > /dev/null && bench "bf16 prompts .old ($round)" model=ouro-1.4b "$T128" "$cells"
      popd > /dev/null
    fi
  done
  bench "kv fp8 prompts" model=ouro-1.4b engine.kv_dtype=fp8 "$T128" "$cells"
  step "pytest own kv" 40 120 bash -c "python3 -m pytest -m cuda tests/cuda/test_fp8_cuda.py -k own_kv -q -rs \
    -p no:cacheprovider >> $OUT/pytest.txt 2>&1"
  bench "bf16 ttft1k profiled" model=ouro-1.4b 'workload=[ttft1k]' profile_prefill=true
}
s57() {   # lever 137: FP8 products of up to 128 quantized rows on the W8A8 tile (the candidate entry
          # through LOOPSTACK_KERNEL_CONFIGS) against the default, alternating twice on the prompts; the FP8
          # cuda tests with the entry
  local round tile='{"fp8_linear_w8a8": [64, 64, 4, 4, 0, 0, 1, 128]}'
  for round in 1 2; do
    bench "fp8 w+kv prompts ($round)" model=ouro-1.4b "${FP8[@]}" "$T128" 'workload=[t128,ttft1k]'
    LOOPSTACK_KERNEL_CONFIGS="$tile" bench "fp8 w+kv prompts, tile ($round)" model=ouro-1.4b "${FP8[@]}" \
      "$T128" 'workload=[t128,ttft1k]'
  done
  step "pytest fp8" 60 150 bash -c "LOOPSTACK_KERNEL_CONFIGS='$tile' python3 -m pytest -m cuda \
    tests/cuda/test_fp8_cuda.py -q -rs -p no:cacheprovider >> $OUT/pytest.txt 2>&1"
}
s58() {   # lever 138: prompts of up to 4,096 tokens over their own K/V on the paged kernel (captured and eager),
          # against .old (flash / cuDNN past 1,024 tokens): the kernels one layer-plane at a time, then the
          # engine's first tokens alternating twice (one prompt of 1.5K-4K tokens; eight of 1K in one step); the
          # fresh-path GPU tests; FP8 KV once
  local round med=('+workloads.t1500={batch:1,prompt:1500,new:16}' '+workloads.t2k={batch:1,prompt:2048,new:16}'
    '+workloads.t3k={batch:1,prompt:3072,new:16}' '+workloads.t4k={batch:1,prompt:4096,new:16}'
    '+workloads.p8x1k={batch:8,prompt:1024,new:16}')
  local cells='workload=[t1500,t2k,t3k,t4k,p8x1k]'
  step "prefill attention probe" 60 150 python3 tools/decode_kernels_bench.py --groups prefill --budget 110 \
    --out "$OUT/prefill_probe.jsonl"
  for round in 1 2; do
    bench "medium prompts ($round)" model=ouro-1.4b "${med[@]}" "$cells"
    if [ -d .old ]; then
      pushd .old > /dev/null && bench "medium prompts .old ($round)" model=ouro-1.4b "${med[@]}" "$cells"
      popd > /dev/null
    fi
    [ "$round" = 1 ] && step "pytest fresh" 90 200 bash -c "python3 -m pytest -m cuda tests/cuda/test_engine_cuda.py \
      tests/cuda/test_decode_kernels_cuda.py tests/cuda/test_fresh_cuda.py -q -rs -p no:cacheprovider \
      -k 'long_prompt or fresh or cudnn or own_kv' >> $OUT/pytest.txt 2>&1"
  done
  bench "medium prompts, fp8 kv" model=ouro-1.4b engine.kv_dtype=fp8 "${med[@]}" "$cells"
}
s59() {   # lever 138 as landed (cuDNN for one prompt of MHA heads from 1,024 tokens, own K/V for the rest):
          # the probe at Nanbeige's grouped heads, then Ouro's and Nanbeige's prompts against .old, alternating
  local ouro=('+workloads.t1500={batch:1,prompt:1500,new:16}' '+workloads.t2k={batch:1,prompt:2048,new:16}'
    '+workloads.p8x1k={batch:8,prompt:1024,new:16}')
  step "prefill probe, grouped heads" 30 90 python3 tools/decode_kernels_bench.py --groups prefill --budget 60 \
    --heads 48,8 --prefill-cases 1024,2048,8192,4x1024 --out "$OUT/prefill_probe.jsonl"
  bench "ouro prompts" model=ouro-1.4b "${ouro[@]}" 'workload=[ttft1k,t1500,t2k,p8x1k]'
  if [ -d .old ]; then
    pushd .old > /dev/null && bench "ouro prompts .old" model=ouro-1.4b "${ouro[@]}" 'workload=[ttft1k,t1500,t2k,p8x1k]'
    popd > /dev/null
  fi
  bench "nanbeige prompts" model=nanbeige4.2-3b 'workload=[ttft1k,prefill8k]'
  if [ -d .old ]; then
    pushd .old > /dev/null && bench "nanbeige prompts .old" model=nanbeige4.2-3b 'workload=[ttft1k,prefill8k]'
    popd > /dev/null
  fi
  step "pytest fresh" 60 150 bash -c "python3 -m pytest -m cuda tests/cuda/test_engine_cuda.py \
    tests/cuda/test_decode_kernels_cuda.py tests/cuda/test_fresh_cuda.py -q -rs -p no:cacheprovider \
    -k 'long_prompt or fresh or cudnn or own_kv' >> $OUT/pytest.txt 2>&1"
}
s60() {   # lever 138 over FP8: a 1,024-token prompt now attends through cuDNN over the K/V its write hands back
          # dequantized (it took the own-K/V kernel since lever 135), FP8 KV and FP8 weights + KV, against .old
  local kind
  for kind in "engine.kv_dtype=fp8" "${FP8[*]}"; do
    # shellcheck disable=SC2086
    bench "ttft1k $kind" model=ouro-1.4b $kind 'workload=[ttft1k]'
    if [ -d .old ]; then
      # shellcheck disable=SC2086
      pushd .old > /dev/null && bench "ttft1k $kind .old" model=ouro-1.4b $kind 'workload=[ttft1k]'
      popd > /dev/null
    fi
  done
}
w8a8_probe() {   # w8a8_probe ROWS BUDGET COST LIMIT: lever 139's probe of a prompt's W8A8 products at ROWS
                 # (tools/fp8_kernels_bench.py); W8A8_ENTRY: its best tile as LOOPSTACK_KERNEL_CONFIGS, else
                 # the split candidate
  W8A8_ENTRY='{"fp8_linear_w8a8": [64, 64, 4, 4, 0, 0, 1, 128, 0, 0]}'
  step "fp8 prompt products (split)" "$3" "$4" python3 tools/fp8_kernels_bench.py --only prompt \
    --prompt-rows "$1" --budget "$2" --out "$OUT/fp8_prompt.jsonl" --env-out "$OUT/w8a8.json"
  [ -s "$OUT/w8a8.json" ] && W8A8_ENTRY=$(cat "$OUT/w8a8.json")
  echo "W8A8 entry: $W8A8_ENTRY" >> "$LOG"
}
s61() {   # lever 139: a prompt's W8A8 products of up to 128 rows on the tile kernel with K split: the probe
          # at 128 rows, then its best tile against _scaled_mm in the engine (FP8 weights + KV), and the b1
          # cells against $OLD (the tree before: the decode GEMV's split epilogue moved into gemv's split_k
          # helpers)
  local round split prompts=('workload=[t128,ttft1k]')
  w8a8_probe 128 170 90 200
  split=$W8A8_ENTRY
  for round in 1 2; do
    LOOPSTACK_KERNEL_CONFIGS=$split bench "fp8 prompts split tile ($round)" model=ouro-1.4b "${FP8[@]}" \
      "$T128" "${prompts[@]}"
    bench "fp8 prompts scaled_mm ($round)" model=ouro-1.4b "${FP8[@]}" "$T128" "${prompts[@]}"
    if (( round == 1 )); then
      bench "bf16 prompts" model=ouro-1.4b "$T128" "${prompts[@]}"
      bench "ouro b1 bf16" model=ouro-1.4b 'workload=[b1]'
      old_bench "ouro b1 bf16 $OLD" model=ouro-1.4b 'workload=[b1]'
    fi
  done
  LOOPSTACK_KERNEL_CONFIGS=$split step "pytest fp8 (split entry)" 60 150 bash -c "python3 -m pytest -m cuda \
    tests/cuda/test_fp8_cuda.py -q -rs -p no:cacheprovider >> $OUT/pytest.txt 2>&1"
  LOOPSTACK_KERNEL_CONFIGS=$split bench "b64 fp8 split tile" model=ouro-1.4b "${FP8[@]}" 'workload=[b64]'
  bench "b64 fp8 scaled_mm" model=ouro-1.4b "${FP8[@]}" 'workload=[b64]'
  bench "ouro b1 fp8" model=ouro-1.4b "${FP8[@]}" 'workload=[b1]'
  old_bench "ouro b1 fp8 $OLD" model=ouro-1.4b "${FP8[@]}" 'workload=[b1]'
}
s62() {   # lever 139 with each split at least fp8_linear.MIN_K_PER_SPLIT of K (only down splits, in two) and
          # PDL with the first weight tile before the wait: the probe at 64 and 128 rows, then its best tile
          # against _scaled_mm at 128 and 1,024-token prompts and batch 64
  local round split
  w8a8_probe 64,128 100 60 120
  split=$W8A8_ENTRY
  step "pytest w8a8 tile" 40 120 bash -c "python3 -m pytest -m cuda tests/cuda/test_fp8_cuda.py -q -rs \
    -p no:cacheprovider -k 'w8a8_tile' >> $OUT/pytest.txt 2>&1"
  for round in 1 2; do
    LOOPSTACK_KERNEL_CONFIGS=$split bench "fp8 prompts tile ($round)" model=ouro-1.4b "${FP8[@]}" "$T128" \
      'workload=[t128,ttft1k]'
    bench "fp8 prompts scaled_mm ($round)" model=ouro-1.4b "${FP8[@]}" "$T128" 'workload=[t128,ttft1k]'
    LOOPSTACK_KERNEL_CONFIGS=$split bench "b64 fp8 tile ($round)" model=ouro-1.4b "${FP8[@]}" 'workload=[b64]'
    bench "b64 fp8 scaled_mm ($round)" model=ouro-1.4b "${FP8[@]}" 'workload=[b64]'
  done
  bench "bf16 prompts" model=ouro-1.4b "$T128" 'workload=[t128,ttft1k]'
}
s63() {   # lever 139 as landed (the sm_90 table's `fp8_linear_w8a8`): the FP8 cuda tests on the table, then the
          # table against `_scaled_mm` (the entry removed) at 128- and 1,024-token prompts and batch 64, FP8
          # weights + KV, each form first once (call A's 1,024-token rounds, +0.3-0.5 ms with the entry, ran
          # it first every time)
  local round cells=('workload=[t128,ttft1k,b64]') none='{"fp8_linear_w8a8": null}'
  step "pytest fp8 (table)" 70 150 bash -c "python3 -m pytest -m cuda tests/cuda/test_fp8_cuda.py -q -rs \
    -p no:cacheprovider >> $OUT/pytest.txt 2>&1"
  for round in table scaled_mm scaled_mm table; do
    if [ "$round" = table ]; then
      bench "fp8 prompts b64 (table)" model=ouro-1.4b "${FP8[@]}" "$T128" "${cells[@]}"
    else
      LOOPSTACK_KERNEL_CONFIGS=$none bench "fp8 prompts b64 scaled_mm" model=ouro-1.4b "${FP8[@]}" "$T128" \
        "${cells[@]}"
    fi
  done
}
s64() {   # lever 140: the deep W8A8 entry (256 of K a step, 3 stages) where a product's tiles fit two an SM,
          # against the table (lever 139's entry alone) at a 128-token prompt and batch 64, FP8 weights + KV;
          # the cuda tile test first (the three candidates at Ouro's shapes)
  local round cells=('workload=[t128,b64]')
  local deep='{"fp8_linear_w8a8_deep": [64, 64, 4, 3, 0, 0, 1, 256, 0, 0]}'
  step "pytest w8a8 tile" 40 120 bash -c "python3 -m pytest -m cuda tests/cuda/test_fp8_cuda.py -q -rs \
    -p no:cacheprovider -k 'w8a8_tile' >> $OUT/pytest.txt 2>&1"
  for round in deep table table deep; do     # each form first once (lever 139's A/B ran its tile first)
    if [ "$round" = deep ]; then
      LOOPSTACK_KERNEL_CONFIGS=$deep bench "fp8 t128 b64 deep" model=ouro-1.4b "${FP8[@]}" "$T128" \
        "${cells[@]}"
    else
      bench "fp8 t128 b64 table" model=ouro-1.4b "${FP8[@]}" "$T128" "${cells[@]}"
    fi
  done
}
s66() {   # levers 139 (the landed table), 140 (the deep entry) and 141 (PDL on the quantizing kernels) in
          # one round trip, FP8 weights + KV at a 128- and a 1,024-token prompt and batch 64: this tree (table
          # + 141), the same without the W8A8 entry (`_scaled_mm`), with the deep entry, and $OLD (OLD=.head:
          # this tree with hal/kernels/fp8_rows.py as at 5f35773, before 141), in the order a b c d d c b a;
          # the FP8 cuda tests first, a profile last
  local form cells=('workload=[t128,ttft1k,b64]') none='{"fp8_linear_w8a8": null}'
  local deep='{"fp8_linear_w8a8_deep": [64, 64, 4, 3, 0, 0, 1, 256, 0, 0]}'
  [ -d "$OLD" ] || STATUS+=("s66: no $OLD carried (OLD=.head): lever 141 not compared")
  step "pytest fp8" 70 150 bash -c "python3 -m pytest -m cuda tests/cuda/test_fp8_cuda.py -q -rs \
    -p no:cacheprovider >> $OUT/pytest.txt 2>&1"
  for form in table scaled_mm deep old old deep scaled_mm table; do
    case $form in
      table) bench "fp8 table (139 + 141)" model=ouro-1.4b "${FP8[@]}" "$T128" "${cells[@]}" ;;
      scaled_mm) LOOPSTACK_KERNEL_CONFIGS=$none bench "fp8 scaled_mm" model=ouro-1.4b "${FP8[@]}" "$T128" \
        "${cells[@]}" ;;
      deep) LOOPSTACK_KERNEL_CONFIGS=$deep bench "fp8 deep (140)" model=ouro-1.4b "${FP8[@]}" "$T128" \
        "${cells[@]}" ;;
      old) old_bench "fp8 $OLD (before 141)" model=ouro-1.4b "${FP8[@]}" "$T128" "${cells[@]}" ;;
    esac
  done
  bench "fp8 t128 profile" model=ouro-1.4b "${FP8[@]}" "$T128" 'workload=[t128]' profile_prefill=true
}
profile() {   # where Ouro-1.4B's b1 step goes since the sm_90 table's one-row entries, bf16 and FP8 weights + KV
  bench "ouro b1 bf16 profile" model=ouro-1.4b 'workload=[b1]' profile=4
  bench "ouro b1 fp8 profile" model=ouro-1.4b "${FP8[@]}" 'workload=[b1]' profile=4
}
profile_batches() {   # where the b8 steps (bf16, FP8 weights + KV on the W8A8 rows) and the b64 step go
  bench "b8 fp8 profile" model=ouro-1.4b "${FP8[@]}" 'workload=[b8]' profile=4
  bench "b8 bf16 profile" model=ouro-1.4b 'workload=[b8]' profile=4
  bench "b64 profile" model=ouro-1.4b 'workload=[b64]' profile=4
}
smallbatch() {   # FP8 weights + KV against bf16 at 2 and 4 rows (1K in, 128 out): the W8A8 rows of lever 122
  local w=('+workloads.b2={batch:2,prompt:1024,new:128}' '+workloads.b4={batch:4,prompt:1024,new:128}')
  bench "b2 b4 fp8" model=ouro-1.4b "${FP8[@]}" "${w[@]}" 'workload=[b2,b4]'
  bench "b2 b4 bf16" model=ouro-1.4b "${w[@]}" 'workload=[b2,b4]'
}
ring() {   # the ring's configs per shape of RING_MODEL (tools/ring_sweep.py), then its b1 step with them
  local model=${RING_MODEL:-nanbeige4.2-3b} round
  step "ring sweep $model" 150 240 python3 tools/ring_sweep.py --models "$model" --out "$OUT/ring_rows.jsonl" \
    --env-out "$OUT/ring.json"
  [ -s "$OUT/ring.json" ] || return
  for round in 1 2; do     # alternating with the table's configs
    LOOPSTACK_RING_CONFIGS=$(cat "$OUT/ring.json") bench "$model b1 swept ring ($round)" model="$model" 'workload=[b1]'
    bench "$model b1 table ring ($round)" model="$model" 'workload=[b1]'
  done
}
landed() {   # the fifty-second session's defaults beside what they replaced (lever 125: Huginn-0125's swept ring
             # configs against lever 97's DEFAULT at those shapes), and the b8 cells with FP8 on the W8A8 rows (122)
  local round old_ring='{"15840,5280": [1, 8, 256, 4, 6, 4], "5280,5280": [1, 8, 256, 4, 6, 4],
    "35840,5280": [1, 8, 256, 4, 6, 4]}'
  for round in 1 2; do
    bench "huginn b1 ($round)" model=huginn-0125 'workload=[b1]'
    LOOPSTACK_RING_CONFIGS=$old_ring bench "huginn b1 DEFAULT ring ($round)" model=huginn-0125 'workload=[b1]'
  done
  bench "b8 fp8" model=ouro-1.4b "${FP8[@]}" 'workload=[b8]'
  bench "b8 bf16" model=ouro-1.4b 'workload=[b8]'
}
tcrows() {   # lever 126: bf16 decode batches of 2-8 rows on the fused projections (gemv.py's tl.dot), and on the
             # tensor-core slices with a 16-row entry, against cuBLAS (the default past one row)
  LOOPSTACK_DECODE_PROJECTIONS=1 bench "b8 bf16 fused rows" model=ouro-1.4b 'workload=[b8]'
  LOOPSTACK_DECODE_PROJECTIONS=1 LOOPSTACK_KERNEL_CONFIGS='{"gemv_slice_tc": [16, 128, 4, 1, 0, 0, 1, 256, 32]}' \
    bench "b8 bf16 tc slices" model=ouro-1.4b 'workload=[b8]'
  bench "b8 bf16 (again)" model=ouro-1.4b 'workload=[b8]'
}

GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "$GPU; $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')" | tee "$LOG"
case $GPU in    # PARTS for any card, else H200_PARTS or OTHER_PARTS (e.g. "tests ring rows" for a second call)
  *H200*) PARTS=${PARTS:-${H200_PARTS:-cells tests ring rows}} ;;
  *) PARTS=${PARTS:-${OTHER_PARTS:-tests configs cells rows}} ;;
esac
for part in $PARTS; do $part; done

{ echo "===== summary ($GPU)"; printf '%s\n' "${STATUS[@]}"; } | tee -a "$LOG"
[ -f "$ROWS" ] && python3 - "$ROWS" <<'EOF' | tee -a "$LOG"
import json, sys
keys = ["model", "workload", "kv_dtype", "weights_dtype", "batch", "decode_ms_step", "decode_tok_s", "decode_vs_floor",
        "wall_vs_device", "copy_tb_s", "decode_vs_measured_floor", "ttft_ms", "prefill_tok_s"]
print(" | ".join(keys + ["configs from the environment"]))
for line in open(sys.argv[1]):
    row = json.loads(line)
    env = row.get("kernel_configs") or row.get("ring_configs") or ""
    print(" | ".join([str(row.get(k, "")) for k in keys] + [env]))
EOF
grep -h '"mode"' "$OUT/peer.txt" 2>/dev/null | tee -a "$LOG"
grep -hE "passed|failed|error" "$OUT/pytest.txt" 2>/dev/null | tail -n 4 | tee -a "$LOG"
