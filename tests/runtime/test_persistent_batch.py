"""The persistent batch: a decode step's host work grows with what changed, not with the batch, and
outputs stay the simple path's."""
from collections import Counter
from contextlib import contextmanager
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hal
import zoo
from helpers import golden_case, single_thread  # noqa: F401 (fixture)
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.sequence import Request
from runtime.execution.sampler import SamplingTensors
from runtime.execution.reference import generate_reference

CPU = hal.get("cpu")
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::lift_fresh")


class CountOps(TorchDispatchMode):
    """Counts the tensor ops issued (on the CPU every host-to-device copy is a copy op too), except
    inside the CPU reference attention, whose clear-rather-than-fast math loops over sequences."""

    def __init__(self, backend) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.paused = False
        for name in ("forward", "write_kv"):
            original = getattr(backend, name)

            def uncounted(*args, _original=original, **kwargs):
                self.paused = True
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.paused = False
            setattr(backend, name, uncounted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class HostWork(NamedTuple):
    """What one decode step cost the host."""

    row_writes: int              # block-table rows and sampling-settings rows written one by one
    uploads: int                 # host-to-device copies of the rows' sampling settings and positions
    ops: Counter                 # tensor ops issued (host-to-device copies among them, COPY_OPS)
    per_row_calls: int           # calls of the per-row sampling builder and the host stop check
    num_finish_codes: int        # requests whose stop the device decided


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def mixed(i: int) -> SamplingParams:
    """Greedy, seeded top-k with stop tokens held back by min_tokens, unseeded top-p, seeded both;
    nobody can stop before the counted step (the third token)."""
    return [greedy(i), SamplingParams(max_tokens=8, temperature=0.8, top_k=5, seed=i, stop_token_ids=(7,),
                                      min_tokens=4),
            SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, ignore_eos=True),
            SamplingParams(max_tokens=8 + i % 3, temperature=0.7, top_k=3, top_p=0.8, seed=i, ignore_eos=True)][i % 4]


@contextmanager
def counting_calls(calls: list, *where: tuple[type, str]):
    """Count the calls of each `owner.name` (a class's method) while inside."""
    raw = [(owner, name, vars(owner)[name]) for owner, name in where]
    for owner, name, _ in raw:
        setattr(owner, name, lambda *a, _original=getattr(owner, name), **k: calls.append(1) or _original(*a, **k))
    try:
        yield
    finally:
        for owner, name, attribute in raw:
            setattr(owner, name, attribute)


def steady_decode_step(num_requests: int, params_of=greedy) -> HostWork:
    """One decode step of `num_requests` requests that join and leave nothing and need no new KV
    block (positions 21 -> 22, blocks of 16 tokens)."""
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    engine = LLMEngine(model, CPU, EngineConfig(block_size=16, max_num_seqs=num_requests,
                                                max_num_batched_tokens=32 * num_requests, max_model_len=64))
    for i in range(num_requests):
        engine.add_request(str(i), [1 + (i * 7 + j) % 50 for j in range(20)], params_of(i))
    engine.step()                      # every prompt in one step
    engine.step()                      # the first decode step: rows join the persistent batch
    batch, device_rows = engine.runner.input_batch, engine.runner.row_sampling
    writes, uploads = batch.num_row_writes + batch.params.num_row_writes, device_rows.num_uploads
    calls, codes = [], []
    finish_step = engine.runner.finish_step

    def finish(*args, **kwargs):
        result = finish_step(*args, **kwargs)
        codes.append(len(result.codes or ()))
        return result

    engine.runner.finish_step = finish
    with counting_calls(calls, (SamplingTensors, "build"), (Request, "check_stop")), \
            CountOps(engine.runner.backend) as ops:
        outputs = engine.step()
    assert len(outputs) == num_requests and not any(o.finished for o in outputs)
    return HostWork(batch.num_row_writes + batch.params.num_row_writes - writes, device_rows.num_uploads - uploads,
                    ops.counts, len(calls), sum(codes))


@pytest.mark.slow
@pytest.mark.parametrize("params_of", [greedy, mixed])
def test_host_work_of_a_decode_step_does_not_grow_with_the_batch(single_thread, params_of):
    """Sampling settings are gathered by row and stops decided on the device: the host's work in a
    step with no joins or leaves is the same at 16 and 256 requests, and it calls no per-row builder."""
    small, large = steady_decode_step(16, params_of), steady_decode_step(256, params_of)
    assert small.row_writes == large.row_writes == 0
    assert small.uploads == large.uploads == 1                     # the step's rows and positions
    assert small.per_row_calls == large.per_row_calls == 0
    assert (small.num_finish_codes, large.num_finish_codes) == (16, 256)
    copies = {op: small.ops[op] for op in COPY_OPS}
    assert copies == {op: large.ops[op] for op in COPY_OPS}, (copies, {op: large.ops[op] for op in COPY_OPS})
    assert sum(small.ops.values()) == sum(large.ops.values())     # and every other op: the math is batched


def test_rows_follow_joins_leaves_and_new_blocks(single_thread):
    """Requests of different lengths join and finish at different steps, cross block boundaries and
    reuse freed rows: the tokens equal the simple path's."""
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    engine = LLMEngine(model, CPU, EngineConfig(block_size=4, max_num_seqs=3, max_num_batched_tokens=16))
    prompts = [case.prompt(i % case.num_prompts)[: 3 + i] for i in range(6)]
    outs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True))
        for out in engine.step():
            outs[out.request_id] = out.token_ids
    for out in engine.run_until_done():
        outs[out.request_id] = out.token_ids
    batch = engine.runner.input_batch
    assert not batch.row_of and len(batch.free_rows) == 3           # every row went back
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True)
        assert outs[str(i)] == generate_reference(model, prompt, params)[0], f"request {i}"
