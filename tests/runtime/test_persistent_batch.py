"""The persistent batch: a decode step's host work grows with what changed, not with the batch, and
outputs stay the simple path's."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hal
import zoo
from helpers import golden_case, single_thread  # noqa: F401 (fixture)
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
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


def steady_decode_step(num_requests: int) -> tuple[int, Counter]:
    """Rows written and ops issued by one decode step of `num_requests` requests that join and
    leave nothing and need no new KV block (positions 21 -> 22, blocks of 16 tokens)."""
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    engine = LLMEngine(model, CPU, EngineConfig(block_size=16, max_num_seqs=num_requests,
                                                max_num_batched_tokens=32 * num_requests, max_model_len=64))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), [1 + (i * 7 + j) % 50 for j in range(20)], params)
    engine.step()                      # every prompt in one step
    engine.step()                      # the first decode step: rows join the persistent batch
    batch = engine.runner.input_batch
    writes = batch.num_row_writes
    with CountOps(engine.runner.backend) as ops:
        engine.step()
    return batch.num_row_writes - writes, ops.counts


@pytest.mark.slow
def test_host_work_of_a_decode_step_does_not_grow_with_the_batch(single_thread):
    small_writes, small = steady_decode_step(16)
    large_writes, large = steady_decode_step(256)
    assert small_writes == large_writes == 0
    copies = {op: small[op] for op in COPY_OPS}
    assert copies == {op: large[op] for op in COPY_OPS}, (copies, {op: large[op] for op in COPY_OPS})
    assert sum(small.values()) == sum(large.values())     # and every other op: the math is batched


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
