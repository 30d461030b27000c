"""The zoo families with every fused decode op of the CUDA/ROCm Hals (hal/kernels, run by the Triton
interpreter): the wiring in zoo/layers.py and the families, through the dense context and through
the engine's paged context with graphs."""
from __future__ import annotations

import collections

import pytest
import torch

import zoo
import zoo.layers
from zoo.fuse import fuse_projections
from hal.cpu import CpuHal
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import configs_for
from hal.kernels.gemv import gemv_ops
from hal.kernels.ops import fused_ops
from helpers import golden_case
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("interpreted")

SMALL_OPS = ("rms_norm", "rotary", "silu_and_mul")
PROJECTION_OPS = ("linear", "rms_norm_linear", "silu_mul_linear", "norm_residual_linear")
CASES = ["ouro-tiny-gqa-bf16", "nanbeige-tiny", "huginn-tiny"]


@pytest.fixture
def use_ops(monkeypatch):
    """`use_ops(names)`: zoo.layers.inference_op answers with those Triton ops (the others None);
    returns a Counter of calls per op name."""
    def install(names):
        calls = collections.Counter()
        table = {**fused_ops(configs_for("default")), **gemv_ops(configs_for("default"), 4)}

        def counted(name, fn):
            def call(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return call

        monkeypatch.setattr(zoo.layers, "_FUSED", {(n, "cpu"): counted(n, table[n]) if n in names else None
                                                   for n in SMALL_OPS + PROJECTION_OPS})
        return calls
    return install


def _model(name: str, dtype: str):
    model = zoo.from_pretrained(golden_case(name).path, dtype=dtype)
    return fuse_projections(model.eval())


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    kwargs = {"init_scale": 0.0} if "init_scale" in model.forward.__code__.co_varnames else {}
    with torch.inference_mode():
        return model(ids, **kwargs).logits.float()


@pytest.mark.parametrize("name", CASES)
def test_projection_ops_are_the_unfused_path_in_float32(name, use_ops):
    """float32 (golden runs): the projection ops take the unfused kernels, bit for bit."""
    model = _model(name, "float32")
    ids = torch.tensor([golden_case(name).prompt(0)[:6]])
    use_ops(SMALL_OPS)
    plain = _logits(model, ids)
    calls = use_ops(SMALL_OPS + PROJECTION_OPS)
    assert torch.equal(_logits(model, ids), plain)
    assert {"rms_norm_linear", "silu_mul_linear"} <= set(calls), calls


@pytest.mark.parametrize("name", CASES)
def test_fused_bf16_is_as_close_to_float32_as_unfused(name, use_ops):
    """bf16 decode-sized batches (6 rows) through the fused kernels: no further from the float32
    logits than the unfused bf16 path (the kernels round where torch rounds; only sum orders differ)."""
    ids = torch.tensor([golden_case(name).prompt(0)[:6]])
    use_ops(())
    truth = _logits(_model(name, "float32"), ids)
    model = _model(name, "bfloat16")
    use_ops(SMALL_OPS)
    plain_err = (_logits(model, ids) - truth).abs().max().item()
    calls = use_ops(SMALL_OPS + PROJECTION_OPS)
    fused_err = (_logits(model, ids) - truth).abs().max().item()
    sandwich = {"ouro-tiny-gqa-bf16", "huginn-tiny"}
    expected = {"rms_norm_linear", "silu_mul_linear"} | ({"norm_residual_linear"} if name in sandwich else {"linear"})
    assert expected <= set(calls), calls
    assert fused_err <= 1.5 * plain_err + 2e-2, f"{name}: fused {fused_err:.3g} vs unfused {plain_err:.3g}"


class TritonOnCpu(CpuHal):
    def attention(self, num_heads, num_kv_heads, head_dim, dtype, block_size=None, backend=None, kv_dtype=None):
        return TritonPagedAttention(num_heads, num_kv_heads, head_dim, dtype, self.device(), block_size or 16)


def test_engine_with_fused_ops_graphs_equal_eager_bf16(use_ops, monkeypatch):
    """Decode through every fused op and the rotary + KV-write kernel: graphs on and off give the
    same tokens (the same kernels either way)."""
    case = golden_case("ouro-tiny-gqa-bf16")
    model = _model(case.name, "bfloat16")
    fused_writes = collections.Counter()
    write = TritonPagedAttention.write_kv_rotary

    def counted_write(self, *args):
        fused_writes["write_kv_rotary"] += 1
        return write(self, *args)

    monkeypatch.setattr(TritonPagedAttention, "write_kv_rotary", counted_write)
    calls = use_ops(SMALL_OPS + PROJECTION_OPS)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, num_loops=1)   # the interpreter is slow
    outs = {}
    with torch.inference_mode():
        for graphs in (False, True):
            engine = LLMEngine(model, TritonOnCpu(), EngineConfig(block_size=4, max_num_batched_tokens=16,
                                                                  graphs=graphs))
            engine.add_request("0", case.prompt(0)[:5], params)
            outs[graphs] = [o.token_ids for o in engine.run_until_done()]
    assert outs[True] == outs[False]
    assert fused_writes["write_kv_rotary"] and calls["norm_residual_linear"], (fused_writes, calls)
