"""Which products the CUDA Hal's TMA ring takes (hal/cuda/ring_gemv.py), decided on the host: one
contiguous 16-bit row at a shape of its table (every shape with LOOPSTACK_RING_GEMV=1), sm_90 only;
everything else goes to the library product unchanged. No GPU needed (tests/cuda/test_ring_gemv_cuda.py
runs the kernel; tests/kernels/test_xcompile_ring.py compiles it for sm_90). LOOPSTACK_RING_CONFIGS replaces
the table's entries with what tools/ring_sweep.py measured."""
import json
import sys
from pathlib import Path

import pytest
import torch

ring = pytest.importorskip("hal.cuda.ring_gemv", exc_type=ImportError)


def _library(calls):
    def library(x, w):
        calls.append(tuple(x.shape))
        return torch.nn.functional.linear(x, w)
    return library


def test_table_is_sm_90_and_names_whole_model_shapes():
    assert set(ring.TABLE) == {"sm_90"}
    shapes = ring.TABLE["sm_90"]
    assert set(ring.NANBEIGE_4_2_3B) <= set(shapes) and set(ring.HUGINN_0125) <= set(shapes)
    for (n, k), config in shapes.items():
        assert n > 0 and k % 8 == 0           # rows TMA can address: 16-byte strides
        assert config.block_k <= 256 and config.block_n * config.block_k * config.boxes * 2 <= 32 << 10


def test_only_one_contiguous_16_bit_row_at_a_table_shape_is_taken():
    routed = ring.RingOr(_library([]), {(64, 32): ring.DEFAULT}, every=False, pdl=True)
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    assert routed.config(torch.zeros(1, 32, dtype=torch.bfloat16), w) == ring.DEFAULT
    assert routed.config(torch.zeros(1, 1, 32, dtype=torch.bfloat16), w) == ring.DEFAULT     # leading dims
    assert routed.prefers(torch.zeros(1, 32, dtype=torch.bfloat16), w)          # what the fused ops hand over
    assert not routed.prefers(torch.zeros(2, 32, dtype=torch.bfloat16), w)
    assert routed.config(torch.zeros(2, 32, dtype=torch.bfloat16), w) is None                # two rows
    assert routed.config(torch.zeros(1, 32), w.float()) is None                              # float32
    assert routed.config(torch.zeros(1, 64, dtype=torch.bfloat16)[:, ::2], w) is None        # strided row
    assert routed.config(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(48, 32, dtype=torch.bfloat16)) is None
    fp8, scale = torch.zeros(64, 32, dtype=torch.float8_e4m3fn), torch.ones(64)   # the tools' W8A16 form
    assert ring.takes(torch.zeros(1, 32, dtype=torch.bfloat16), fp8, scale)
    assert not ring.takes(torch.zeros(1, 32, dtype=torch.bfloat16), fp8)                     # no scale
    assert not ring.takes(torch.zeros(1, 32, dtype=torch.bfloat16), w, scale)                # 16-bit weight
    assert not ring.takes(torch.zeros(1, 32, dtype=torch.bfloat16), fp8, scale.double())    # float64 scale
    assert not ring.takes(torch.zeros(1, 32, dtype=torch.bfloat16), fp8, torch.ones(48))     # scale per row
    every = ring.RingOr(_library([]), {}, every=True, pdl=True)
    assert every.config(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(48, 32, dtype=torch.bfloat16)) \
        == ring.DEFAULT


def test_what_the_ring_does_not_take_reaches_the_library_unchanged():
    calls = []
    routed = ring.RingOr(_library(calls), {(64, 32): ring.DEFAULT}, every=False, pdl=True)
    x, w = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16)
    assert torch.equal(routed(x, w), torch.nn.functional.linear(x, w))
    assert calls == [(3, 32)]


def test_the_switch_and_the_arch(monkeypatch):
    lib = _library([])
    monkeypatch.delenv(ring.ENV, raising=False)
    assert isinstance(ring.ring_or(lib, "sm_90", True), ring.RingOr)
    assert ring.ring_or(lib, "sm_80", True) is lib and ring.ring_or(lib, "sm_100", True) is lib
    monkeypatch.setenv(ring.ENV, "0")
    assert ring.ring_or(lib, "sm_90", True) is lib
    monkeypatch.setenv(ring.ENV, "1")
    assert ring.ring_or(lib, "sm_90", False).every
    monkeypatch.setenv(ring.ENV, "yes")
    with pytest.raises(ValueError, match="LOOPSTACK_RING_GEMV"):
        ring.ring_or(lib, "sm_90", True)


def test_ring_configs_from_the_environment_replace_or_remove_table_entries(monkeypatch):
    lib = _library([])
    monkeypatch.delenv(ring.ENV, raising=False)
    qkv, o = (8192, 3072), (3072, 6144)      # two of Nanbeige4.2-3B's table shapes
    monkeypatch.setenv(ring.CONFIGS_ENV,
                       '{"8192,3072": [1, 16, 256, 4, 4, 8], "3072,6144": null, "64,32": [1, 8, 256, 2, 4, 4]}')
    routed = ring.ring_or(lib, "sm_90", True)
    assert routed.shapes[qkv] == ring.RingConfig(1, 16, 256, 4, 4, 8)
    assert o not in routed.shapes and (64, 32) in routed.shapes
    x = torch.zeros(1, 6144, dtype=torch.bfloat16)
    assert routed.config(x, torch.zeros(o, dtype=torch.bfloat16)) is None    # null: the library runs it
    # removing every shape leaves the library itself
    every_shape = ", ".join(f'"{n},{k}": null' for n, k in ring.TABLE["sm_90"])
    monkeypatch.setenv(ring.CONFIGS_ENV, "{" + every_shape + "}")
    assert ring.ring_or(lib, "sm_90", True) is lib


@pytest.mark.parametrize("text, match", [
    ('{"8192": [1, 8, 256, 4, 6, 4]}', "N,K of the weight"),              # no K
    ('{"8192,3072": [1, 8, 256, 4]}', "missing"),                         # too few fields
    ('{"8192,3072": [1, 16, 256, 4, 8, 8]}', "256 KiB an SM"),             # stages past shared memory
    ('{"8192,3072": [1, 8, 100, 4, 6, 4]}', "multiple of 16"),
    ("[1, 8]", "expected JSON like"),
])
def test_bad_ring_configs_name_the_fix(monkeypatch, text, match):
    monkeypatch.delenv(ring.ENV, raising=False)
    monkeypatch.setenv(ring.CONFIGS_ENV, text)
    with pytest.raises(ValueError, match=match):
        ring.ring_or(_library([]), "sm_90", True)


def test_the_sweep_picks_what_beats_the_library_in_the_form_the_engine_reads():
    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    import ring_sweep

    config = [1, 8, 256, 4, 6, 4]
    rows = [{"n": 64, "k": 32, "variant": "library", "us": 10.0},
            {"n": 64, "k": 32, "variant": "ring a", "us": 9.5, "config": [1, 16, 256, 4, 4, 8]},
            {"n": 64, "k": 32, "variant": "ring b", "us": 9.0, "config": config},
            {"n": 32, "k": 64, "variant": "library", "us": 5.0},
            {"n": 32, "k": 64, "variant": "ring a", "us": 6.0, "config": config}]
    picked = ring_sweep.choices(rows)
    assert picked == {"64,32": config, "32,64": None}
    assert ring.table_overrides(json.dumps(picked)) == {(64, 32): ring.RingConfig(*config), (32, 64): None}
    tried = ring_sweep._configs()        # whichever of them a sweep picks, the engine takes
    as_env = json.dumps({f"{n},16": list(c) for n, c in enumerate(tried, 1)})
    assert len(tried) == 20 and len(ring.table_overrides(as_env)) == 20
