"""Stops decided on the device (runtime/execution/row_sampling.py): the finish codes equal the host's
`Request.check_stop`, and the engine's outputs are those of the per-row host path, with sync and
async scheduling, n > 1 and best_of, stop tokens, min_tokens, max_tokens and the context's end."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import hal
import zoo
from helpers import golden_case, single_thread  # noqa: F401 (fixture)
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.sequence import STATUS_OF_CODE, Request
from runtime.execution.reference import generate_reference
from runtime.execution.row_params import RowParams
from runtime.execution.row_sampling import RowSampling, StepRows
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")
ENGINE_STOPS = frozenset({2, 9})


def request(params: SamplingParams, num_prompt: int, max_seq_len: int = 1 << 30) -> Request:
    return Request("r", list(range(10, 10 + num_prompt)), params, 1, 1.0, 1,
                   stop_token_ids=frozenset() if params.ignore_eos else ENGINE_STOPS, max_seq_len=max_seq_len)


def test_device_codes_equal_check_stop():
    """Every (request, output count, token) of a grid: stop tokens (the engine's, unless ignore_eos,
    and the request's), min_tokens holding them back, max_tokens, the context's end."""
    cases = [request(SamplingParams(max_tokens=6), 3),
             request(SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=(5,)), 3),
             request(SamplingParams(max_tokens=6, stop_token_ids=(5, 2, 40)), 2),
             request(SamplingParams(max_tokens=9, min_tokens=3, temperature=0.5, seed=3), 4),
             request(SamplingParams(max_tokens=20, min_tokens=2, stop_token_ids=(7,)), 5, max_seq_len=11),
             request(SamplingParams(max_tokens=20, ignore_eos=True), 1, max_seq_len=6)]
    params, rows, positions, tokens, want, rng = RowParams(8), [], [], [], [], random.Random(0)
    for row, req in enumerate(cases):
        params.write(row, req)
    for row, req in enumerate(cases):
        for num_outputs in range(1, min(req.params.max_tokens, req.max_seq_len - len(req.prompt_token_ids)) + 1):
            for token in (2, 5, 7, 9, 40, rng.randrange(50, 99)):
                req.output_token_ids = [0] * (num_outputs - 1) + [token]
                rows.append(row)
                positions.append(len(req.prompt_token_ids) + num_outputs - 2)     # the step's input token
                tokens.append(token)
                want.append(req.check_stop())
    device_rows = RowSampling(len(rows), torch.device("cpu"))
    step = device_rows.step(params, np.array(rows), np.array(positions), 100)
    codes = step.stop_codes(torch.tensor(tokens)).tolist()
    assert [STATUS_OF_CODE[c] for c in codes] == want
    assert {s for s in want} == set(STATUS_OF_CODE)                  # every outcome occurs


@pytest.fixture(scope="module")
def tiny():
    return zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")


def run(model, requests, host_path: bool, **options) -> tuple[dict, int]:
    """Outputs by request id, and how many rows had their stop decided on the device.
    `host_path`: decode steps build sampling tensors per row and check stops on the host."""
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(num_kv_blocks=256, block_size=4, **options),
                       extra_stop_token_ids=ENGINE_STOPS)
    finish_step, stop_codes, decided = engine.runner.finish_step, StepRows.stop_codes, []

    def finish(*args, positions=None, **kwargs):
        return finish_step(*args, positions=None if host_path else positions, **kwargs)

    def counted(self, tokens):
        decided.append(len(tokens))
        return stop_codes(self, tokens)

    engine.runner.finish_step = finish
    StepRows.stop_codes = counted
    torch.manual_seed(0)                  # unseeded rows draw from the global RNG
    try:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        outs = {o.request_id: [(s.token_ids, s.finish_reason) for s in o.outputs] for o in engine.run_until_done()}
    finally:
        StepRows.stop_codes = stop_codes
    engine.blocks.check_invariants()
    return outs, sum(decided)


def workload(case, stop: int) -> list:
    prompt = case.prompt(0)
    long_prompt = (case.prompt(1) * 8)[:40]
    kinds = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,)),          # stops on the token
             SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,), min_tokens=6),
             SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),                  # max_tokens
             SamplingParams(max_tokens=30, temperature=0.9, seed=4, ignore_eos=True),       # the context's end
             SamplingParams(max_tokens=10, temperature=1.0, top_k=4, seed=7, stop_token_ids=(stop, 3)),
             SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, n=2, best_of=3, min_tokens=2),
             SamplingParams(max_tokens=7, temperature=0.7, seed=5, n=3, logprobs=2),
             SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3, stop_token_ids=(stop,)),
             SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, ignore_eos=True)]                # unseeded
    return [(str(i), long_prompt if i == 3 else prompt, p) for i, p in enumerate(kinds)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_outputs_equal_the_host_path(tiny, async_scheduling):
    case = golden_case("ouro-tiny")
    stop = case.greedy(0)[3]
    requests = workload(case, stop)
    options = dict(async_scheduling=async_scheduling, max_model_len=48)
    device, decided = run(tiny, requests, host_path=False, **options)
    host, none = run(tiny, requests, host_path=True, **options)
    assert device == host and decided > 0 and none == 0
    assert device["0"][0] == (case.greedy(0)[:case.greedy(0).index(stop) + 1], "stop")
    assert device["1"][0][1] == "stop" and len(device["1"][0][0]) > 6 and stop not in device["1"][0][0][:6]
    assert device["2"][0][1] == "length" and len(device["2"][0][0]) == 5
    assert device["3"][0][1] == "length" and len(device["3"][0][0]) == 48 - 40
    assert len(device["5"]) == 2 and len(device["6"]) == 3


def test_engine_outputs_equal_the_reference(tiny):
    """Single requests (the reference generates one at a time) through the device's stop checks."""
    case = golden_case("ouro-tiny")
    for rid, prompt, params in workload(case, case.greedy(0)[3]):
        if params.n > 1 or params.max_tokens == 30 or params.seed is None and params.temperature > 0:
            continue
        outs, _ = run(tiny, [(rid, prompt, params)], host_path=False)
        tokens, reason, _ = generate_reference(tiny, prompt, params, tuple(ENGINE_STOPS))
        assert outs[rid] == [(tokens, reason)], rid
