"""Config tables, launch options per vendor, and the backend's metadata (no kernels run)."""
from __future__ import annotations

import json
from dataclasses import astuple, replace

import pytest
import torch

from hal.attention import PagedBatch
from hal.kernels import launch
from hal.kernels.splits import MAX_SPLITS, num_kv_splits
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import (KERNEL_NAMES, OPTIONAL_KERNEL_NAMES, KernelConfig, all_configs, configs_for,
                                 overrides)


def test_every_table_has_every_kernel():
    for arch, table in all_configs().items():
        assert set(table) - set(OPTIONAL_KERNEL_NAMES) == set(KERNEL_NAMES) - set(OPTIONAL_KERNEL_NAMES), arch
    assert configs_for("gfx942:sramecc+:xnack-") == all_configs()["gfx942"]
    assert configs_for("sm_89") == configs_for("gfx90a") == all_configs()["default"]
    assert all(t["attention_prefill"].kpack == 1 for t in all_configs().values())   # gfx950 forces 1


def test_env_override_replaces_table_entries(monkeypatch):
    monkeypatch.setenv("LOOPSTACK_KERNEL_CONFIGS", '{"attention_decode": [16, 32, 4, 4]}')
    table = configs_for("sm_90")
    assert table["attention_decode"] == KernelConfig(16, 32, 4, 4)
    assert table["attention_prefill"] == all_configs()["sm_90"]["attention_prefill"]
    for bad, fix in (('{"attention_decod": [16, 32, 4, 4]}', "unknown kernel 'attention_decod'"),
                     ('{"attention_decode": [16]}', "expected JSON like"), ("16,32,4,4", "expected JSON like"),
                     ('{"attention_decode": null}', "cannot be removed")):
        monkeypatch.setenv("LOOPSTACK_KERNEL_CONFIGS", bad)
        with pytest.raises(ValueError, match=fix):
            configs_for("sm_90")


def test_env_override_null_removes_an_optional_entry(monkeypatch):
    """null takes an optional kernel out of the table (an A/B of a table entry on one tree)."""
    assert "gemv_slice_w8a8" in configs_for("sm_90")
    monkeypatch.setenv("LOOPSTACK_KERNEL_CONFIGS", '{"gemv_slice_w8a8": null, "gemv_slice_tc": null}')
    table = configs_for("sm_90")
    assert "gemv_slice_w8a8" not in table and "gemv_slice_tc" not in table
    assert table["gemv_slice"] == all_configs()["sm_90"]["gemv_slice"]
    assert configs_for("gfx942") == all_configs()["gfx942"]          # absent there already: nothing to remove


def test_pick_decode_configs_takes_the_least_summed_time():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    from pick_decode_configs import pick

    def row(shape, variant, us):
        return {"group": "attn", "shape": shape, "variant": variant, "us": us}

    rows = [row("B64xK1024", "bf16 unified (table config)", 160.0), row("B128xK1024", "bf16 unified (table config)", 310.0),
            row("B64xK1024", "bf16 unified n32 w4 s3 x1", 150.0), row("B128xK1024", "bf16 unified n32 w4 s3 x1", 300.0),
            row("B64xK1024", "bf16 unified n64 w4 s3 x2", 100.0), row("B128xK1024", "bf16 unified n64 w4 s3 x2", 100.0),
            row("B64xK1024", "bf16 unified n128 w4 s2 x1", 140.0),             # one cell only: not a candidate
            row("B64xK1024", "fp8 unified (table config)", 150.0), row("B128xK1024", "fp8 unified (table config)", 300.0),
            row("B64xK1024", "fp8 unified n64 w4 s3 x1", 170.0), row("B128xK1024", "fp8 unified n64 w4 s3 x1", 330.0),
            # the row-stream kernel: slower than the best unified config for bf16, faster for FP8
            row("B64xK1024", "bf16 rows n32 w4 s3 x1", 200.0), row("B128xK1024", "bf16 rows n32 w4 s3 x1", 400.0),
            row("B64xK1024", "fp8 rows n32 w4 s3 x1", 90.0), row("B128xK1024", "fp8 rows n32 w4 s3 x1", 170.0),
            row("B64xK1024", "fp8 rows n64 w4 s2 x1", 80.0), row("B128xK1024", "fp8 rows n64 w4 s2 x1", 200.0)]
    chosen, report = pick(rows)
    table = configs_for("sm_90")
    fp8 = table["attention_decode_fp8"]                                 # the table's wins for FP8
    best = replace(table["attention_decode"], block_n=32, num_warps=4, num_stages=3)   # heads_first stays
    assert chosen == {"attention_decode": list(astuple(best)), "attention_decode_fp8": list(astuple(fp8)),
                      "attention_row_decode_fp8": [1, 32, 4, 3]}
    assert overrides(json.dumps(chosen))["attention_decode"] == best
    assert "470.0 us" in report[0] and "450.0 us" in report[0]      # table, then best
    assert report[-1] == "attention_row_decode_fp8: best [1, 32, 4, 3] 260.0 us"


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_m=48"):
        KernelConfig(48, 64, 4, 2)
    with pytest.raises(ValueError, match="matrix_instr_nonkdim"):
        KernelConfig(64, 64, 4, 2, matrix_instr_nonkdim=8)


def test_amd_keys_only_for_amd_targets(monkeypatch):
    config = all_configs()["gfx942"]["attention_prefill"]
    amd = {"num_warps": 8, "num_stages": 2, "waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 1}
    assert launch.launch_options(config, "hip") == amd
    assert launch.launch_options(config, "cuda") == launch.launch_options(config, "interpreter") == \
        {"num_warps": 8, "num_stages": 2}
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(launch, "_gpu_target", lambda: launch.Target("hip", "gfx942", 64))
    assert launch.backend_of(gpu) == "hip" and launch.backend_of(torch.device("cpu")) == "interpreter"
    monkeypatch.setattr(launch, "_gpu_target", lambda: launch.Target("cuda", "sm_90", 32))
    assert launch.backend_of(gpu) == "cuda"


def test_fp32_attention_uses_accurate_products_per_target():
    from hal.kernels.attention import config_key, dot_precision

    assert dot_precision(torch.float32, "cuda") == "tf32x3"       # never plain TF32
    assert dot_precision(torch.float32, "hip") == dot_precision(torch.bfloat16, "cuda") == "ieee"
    assert config_key("decode", torch.float32) == "attention_decode_fp32"
    assert config_key("prefill", torch.bfloat16) == "attention_prefill"
    # an FP8 cache: bf16 prefill and decode take their own tiles (AMD: narrower prefill; H200: wider
    # decode key tiles); fp32 keeps its
    assert config_key("prefill", torch.bfloat16, True) == "attention_prefill_fp8"
    assert config_key("prefill", torch.float32, True) == "attention_prefill_fp32"
    assert config_key("decode", torch.bfloat16, True) == "attention_decode_fp8"


def test_backend_picks_the_table_of_its_device(monkeypatch):
    monkeypatch.setattr(launch, "_gpu_target", lambda: launch.Target("hip", "gfx950", 64))
    assert launch.target_of(torch.device("cuda", 0)).arch == "gfx950"
    cpu = TritonPagedAttention(4, 2, 24, torch.float32, torch.device("cpu"), 16)
    assert cpu.configs == configs_for("default") and cpu.caps.graphs and cpu.caps.packed_prefill


def test_splits_depend_only_on_batch_shape():
    assert num_kv_splits(1, 16, 132) == MAX_SPLITS          # batch 1 on an H200: fill 132 SMs
    assert num_kv_splits(8, 16, 132) == 4
    assert num_kv_splits(64, 16, 132) == 1
    assert num_kv_splits(0, 16, 132) == MAX_SPLITS


def test_split_cap_from_the_environment_is_checked():
    """`LOOPSTACK_MAX_SPLITS` takes a power of two up to the default 16; anything else names the fix."""
    from hal.kernels.splits import _max_splits

    assert [_max_splits(v) for v in ("1", "4", "16")] == [1, 4, 16]
    for bad in ("3", "32", "0", "four", ""):
        with pytest.raises(ValueError, match="LOOPSTACK_MAX_SPLITS=.*power of two from 1 to 16"):
            _max_splits(bad)


def test_meta_is_contiguous_device_int32_with_host_lengths():
    backend = TritonPagedAttention(4, 2, 24, torch.bfloat16, torch.device("cpu"), 4)
    batch = PagedBatch([3, 1], [3, 6], [[[5], [1, 2]], [[0], [3, 4]]], 4)
    meta = backend.build_meta(batch)
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.seq_lens.tolist() == [3, 6]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [[20, 21, 22, 9], [0, 1, 2, 17]]
    assert all(t.is_contiguous() for t in (meta.block_tables, meta.slot_mapping))
    assert (meta.max_query_len, meta.max_seq_len) == (3, 6)
    assert backend.kv_cache_shape(7) == (2, 7, 4, 2, 24)


def test_bad_calls_raise_with_the_fix():
    with pytest.raises(ValueError, match="head_dim <= 128"):
        TritonPagedAttention(4, 4, 160, torch.float32, torch.device("cpu"), 16)
    backend = TritonPagedAttention(4, 2, 24, torch.float32, torch.device("cpu"), 16)
    meta = backend.build_meta(PagedBatch([1], [1], [[[0]]], 16))
    cache = torch.zeros(backend.kv_cache_shape(1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cast q to the cache dtype"):
        backend.forward(torch.randn(1, 4, 24), cache, meta, 0, 0.2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.forward(torch.randn(1, 4, 24), cache.float(), meta, 0, 0.2)


def test_interpreter_context_leaves_triton_as_it_found_it():
    """Interpreted launches (with device-function calls such as tl.cdiv) must not leave
    triton.language patched, or every later cross-compile in the session fails."""
    import os

    import triton.language as tl
    from triton.runtime import interpreter as interp
    from triton.runtime.jit import JITFunction

    from hal.kernels.ops import silu_and_mul
    from interp import interpreter

    owners = {"core": tl.core, "tensor": tl.core.tensor, "math": tl.math, "jit": JITFunction,
              "builder": interp.InterpreterBuilder}

    def snapshot():   # what attribute lookups return (a restored inherited slot may land in __dict__)
        return {name: {k: getattr(obj, k) for k in dir(obj) if k not in ("__annotations__", "__dict__")}
                for name, obj in owners.items()}

    before, env = snapshot(), os.environ.get("TRITON_INTERPRET")
    with interpreter():
        backend = TritonPagedAttention(2, 1, 16, torch.float32, torch.device("cpu"), 4)
        meta = backend.build_meta(PagedBatch([3], [6], [[[0, 1]]], 4))
        backend.forward(torch.randn(3, 2, 16), torch.randn(backend.kv_cache_shape(2)), meta, 0, 0.3)
        silu_and_mul(torch.randn(2, 8))
    after = snapshot()
    for name in before:
        keys = set(before[name]) | set(after[name])
        changed = [k for k in keys if before[name].get(k) != after[name].get(k)]
        assert not changed, f"{name}: {changed} left patched"
    assert os.environ.get("TRITON_INTERPRET") == env
