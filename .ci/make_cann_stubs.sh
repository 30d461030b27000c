#!/bin/sh
# make_cann_stubs.sh VENV OUTDIR: no-op stand-ins for the CANN shared libraries torch_npu links against,
# so that `LD_LIBRARY_PATH=OUTDIR python -c "import torch_npu"` works on a machine without CANN. Every CANN
# function torch_npu needs is exported as `long f(void) { return 0; }`: op schemas, meta and fake kernels
# work; nothing can run on a device. Needs gcc and binutils' nm. (Recipe: shared/notes/toolchains.md 1.)
set -eu
VENV=$1 OUT=$2
mkdir -p "$OUT"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NPU_LIBS=$(ls "$SITE"/torch_npu/lib/*.so "$SITE"/torch_npu/_C*.so)
SYSTEM_LIBS=$(for lib in libstdc++.so.6 libc.so.6 libm.so.6 libgcc_s.so.1; do gcc -print-file-name=$lib; done)

# what torch, torch_npu and the C/C++ runtimes already export
for f in "$SITE"/torch/lib/*.so* $NPU_LIBS $SYSTEM_LIBS; do
  nm -D --defined-only "$f" 2>/dev/null | awk '{print $3}'
done | sed 's/@.*//' | sort -u > "$OUT/provided.txt"

# what torch_npu needs beyond that: CANN's functions (acl*, aclrt*, Hccl*, rt*, Msprof*, atb::*)
for f in $NPU_LIBS; do
  nm -D --undefined-only "$f" | awk '{print $2}'
done | sed 's/@.*//' | sort -u | comm -23 - "$OUT/provided.txt" \
  | grep -v -E '^_?Py|^_ITM_|^__gmon_start__|^_ZTH' > "$OUT/missing.txt"

awk '{ printf "long stub_%d(void) __asm__(\"%s\");\nlong stub_%d(void) { return 0; }\n", NR, $1, NR }' \
  "$OUT/missing.txt" > "$OUT/stubs.c"
for lib in libhccl libascendcl libacl_op_compiler libge_runner libgraph libacl_tdt_channel libatb; do
  gcc -shared -fPIC -o "$OUT/$lib.so" -Wl,-soname,$lib.so "$OUT/stubs.c"
done
echo "CANN stubs: $(wc -l < "$OUT/missing.txt") functions in $OUT"
