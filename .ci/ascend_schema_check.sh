#!/usr/bin/env bash
# CI: every torch_npu call of hal/ascend against torch-npu's real op schemas and meta kernels (no NPU).
# A separate venv: torch-npu must never enter the main one, where (without CANN) it breaks `import torch`.
set -euo pipefail
cd "${0%/*}/.."
for tool in gcc nm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "ascend schema check SKIPPED: '$tool' not found (gcc and binutils' nm build the stub CANN libraries)"
    exit 0
  fi
done
if [ "$(uname -s)" != Linux ]; then
  echo "ascend schema check SKIPPED: torch-npu ships Linux wheels only"
  exit 0
fi
start=$(date +%s)
VENV=.venv-ascend-ci
python3 -m venv --clear "$VENV"
# torch==2.13.0 must resolve to the CPU build, as in .ci/run: torch_npu refuses a CUDA torch
"$VENV/bin/pip" install -q torch==2.13.0 torch-npu==2.13.0 numpy
sh .ci/make_cann_stubs.sh "$VENV" "$VENV/cann-stubs"
LD_LIBRARY_PATH="$PWD/$VENV/cann-stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONPATH="$PWD" \
  "$VENV/bin/python" -m hal.ascend.schema_check
echo "ascend schema check: $(( $(date +%s) - start ))s including the venv"
