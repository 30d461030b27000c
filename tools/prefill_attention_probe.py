"""Causal attention of one long fresh prompt through the kernels torch ships, per layout (a probe for
docs/performance.md lever 100; the engine's path is hal/kernels/fresh.py's "cudnn" mode).

Why: the 8k prefill's cuDNN attention runs at about 519 TFLOP/s (50.9 ms of 183), below what
Hopper's best causal kernels reach at head dim 128; the engine hands cuDNN strided views of the
packed projection output ([T, H, D] transposed to [1, H, T, D]). Whether a contiguous head-major
layout, or another backend, is faster decides whether the rotary/KV-write kernel should write one.

    python3 tools/prefill_attention_probe.py [--tokens 8192,1024] [--heads 16] [--json rows.jsonl]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,1024")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    h, d = args.heads, args.head_dim
    sink = open(args.json, "a") if args.json else None
    for t in map(int, args.tokens.split(",")):
        qkv = torch.randn(t, 3, h, d, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.unbind(1)                                    # [T, H, D] strided, as the engine's
        qc, kc, vc = (x.transpose(0, 1).contiguous()[None] for x in (q, k, v))   # [1, H, T, D] contiguous
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))               # [1, H, T, D] strided views
        qb, kb, vb = (x.contiguous()[None].transpose(1, 2) for x in (q, k, v))  # BSHD dense, viewed BHSD
        cu = torch.tensor([0, t], device="cuda", dtype=torch.int32)
        flops = 4 * t * t / 2 * h * d
        ref = None
        cases = {
            "cudnn_strided": (SDPBackend.CUDNN_ATTENTION, (qs, ks, vs)),
            "cudnn_bshd": (SDPBackend.CUDNN_ATTENTION, (qb, kb, vb)),
            # the engine before lever 101: q and k from the rotary kernel, v a view of the projection
            "cudnn_qk_bshd_v_strided": (SDPBackend.CUDNN_ATTENTION, (qb, kb, vs)),
            "cudnn_bhsd": (SDPBackend.CUDNN_ATTENTION, (qc, kc, vc)),
            "flash_bhsd": (SDPBackend.FLASH_ATTENTION, (qc, kc, vc)),
            "efficient_bhsd": (SDPBackend.EFFICIENT_ATTENTION, (qc, kc, vc)),
        }
        for name, (backend, (a, b, c)) in cases.items():
            def run(a=a, b=b, c=c, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(a, b, c, is_causal=True)
            try:
                ms = timed(run)
                out = run()
            except RuntimeError as exc:
                print(json.dumps(dict(tokens=t, case=name, error=str(exc)[:160])), flush=True)
                continue
            ref = out if ref is None else ref
            err = (out.float() - ref.float()).abs().max().item()
            # whether the engine's [T, H, D] view of the output is dense (else the o projection copies it)
            row = dict(tokens=t, heads=h, case=name, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                       max_diff=round(err, 5), out_tokens_major=out[0].transpose(0, 1).is_contiguous())
            print(json.dumps(row), flush=True)
            if sink:
                sink.write(json.dumps(row) + "\n")

        def varlen():
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, t, t, 0.0, True, False,
                                                           scale=d ** -0.5)[0]
        ms = timed(varlen)
        row = dict(tokens=t, heads=h, case="flash_varlen_strided", ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        print(json.dumps(row), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            mask = create_block_mask(lambda b, hh, qi, ki: qi >= ki, 1, 1, t, t, device="cuda")
            flex = torch.compile(flex_attention)
            ms = timed(lambda: flex(qc, kc, vc, block_mask=mask))
            err = (flex(qc, kc, vc, block_mask=mask).float() - ref.float()).abs().max().item()
            row = dict(tokens=t, heads=h, case="flex_bhsd", ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                       max_diff=round(err, 5))
        except Exception as exc:        # a probe: report what the compiler said and go on
            row = dict(tokens=t, case="flex_bhsd", error=f"{type(exc).__name__}: {str(exc)[:160]}")
        print(json.dumps(row), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
