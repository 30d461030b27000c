"""A model run by an engine computes with exactly the engine's Hal: attention, fused ops and dense
attention all go through it, and no other Hal is looked up or used."""
from collections import Counter

import pytest
import torch

import hal
import zoo
from hal.cpu import CpuHal
from helpers import golden_case
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.execution.reference import generate_reference
from zoo.context import ModelOps


def _rms_norm(x, weight, eps, residual=None):
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else residual + y


def _silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class CountingHal(CpuHal):
    """The CPU Hal, counting every call a forward makes into it; it offers fused ops the CPU Hal does
    not (torch expressions), so a model that takes fused ops from anywhere else would be caught."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def attention(self, *args, **kwargs):
        backend = super().attention(*args, **kwargs)
        for method in ("write_kv", "forward"):
            original = getattr(backend, method)

            def counted(*a, _original=original, _name=method, **k):
                self.counts[f"attention.{_name}"] += 1
                return _original(*a, **k)
            setattr(backend, method, counted)
        return backend

    def op(self, name):
        fn = {"rms_norm": _rms_norm, "silu_and_mul": _silu_and_mul}.get(name)
        if fn is None:
            return None

        def counted(*args, **kwargs):
            self.counts[f"op.{name}"] += 1
            return fn(*args, **kwargs)
        return counted

    def dense(self, *args, **kwargs):
        self.counts["dense"] += 1
        return super().dense(*args, **kwargs)


@pytest.fixture
def no_other_hal(monkeypatch):
    """Fails any Hal lookup and any call into a Hal other than the one under test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a Hal was looked up during the forward")
    monkeypatch.setattr(hal.registry, "get", refuse)
    monkeypatch.setattr(hal, "get", refuse)


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny", "nanbeige-tiny"])
def test_every_call_of_an_engine_forward_goes_through_its_hal(name, no_other_hal):
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32")
    counting = CountingHal()
    engine = LLMEngine(model, counting, EngineConfig(block_size=4, max_num_batched_tokens=8))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, init_scale=0.0)
    prompts = [case.prompt(i) for i in range(case.num_prompts)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}

    spec = model.kv_spec
    loops = model.default_num_loops
    steps_per_token = spec.layers_per_plane * loops if not spec.num_fixed_planes else None
    assert counting.counts["attention.forward"] == counting.counts["attention.write_kv"] > 0
    if steps_per_token:                    # every attention layer of every loop of every pass
        assert counting.counts["attention.forward"] % steps_per_token == 0
    assert counting.counts["op.rms_norm"] > 0
    assert counting.counts["op.silu_and_mul"] > 0
    assert counting.counts["dense"] == 0   # the engine attends over its paged cache only

    # the simple path and a plain forward take the Hal they are given, and agree with the engine
    ops = ModelOps(counting)
    for i, prompt in enumerate(prompts):
        assert generate_reference(model, prompt, params, ops=ops)[0] == outs[str(i)]
    before = counting.counts["dense"]
    with torch.no_grad():
        model(torch.tensor([prompts[0]]), ops=ops)
    assert counting.counts["dense"] - before == model.num_kv_layers(spec.num_planes(loops))


def test_a_forward_without_a_hal_is_plain_torch(no_other_hal):
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    counting = CountingHal()
    ids = torch.tensor([case.prompt(0)])
    with torch.no_grad():
        plain = model(ids).logits
        through = model(ids, ops=ModelOps(counting)).logits
    assert counting.counts["op.rms_norm"] > 0 and torch.allclose(plain, through, atol=1e-5)
