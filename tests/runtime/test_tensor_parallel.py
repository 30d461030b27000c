"""Tensor parallelism end to end: two processes on gloo, launched by torchrun, give the tp=1 greedy
tokens on every golden case (all have 4 query heads and 4 or 2 KV heads, so tp=2 divides them), with
chunked prefill, preemption (recompute; swap with prefix caching and wavefront prefill) and
speculation rounds; and the tp=1 tokens for KV heads replicated across ranks, early exit with skipped
planes and with every loop run (its exit chosen inside the decode pass), and seeded sampling with Huginn's random initial states."""
import json
import os
import subprocess
import sys

import pytest
import torch

import hal
from helpers import ROOT, golden_case
from runtime.parallel.state import ParallelState, init_distributed

WORKER = ROOT / "tests" / "runtime" / "tp_worker.py"
sys.path.insert(0, str(WORKER.parent))
import tp_worker  # noqa: E402


@pytest.fixture(scope="module")
def tp2_and_tp1_tokens(tmp_path_factory):
    """The worker's tokens at tp=2 and, computed here while it runs, the tp=1 tokens of the jobs
    that have no golden reference."""
    out = tmp_path_factory.mktemp("tp") / "tokens.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(WORKER), str(out)]
    log = out.with_suffix(".log").open("w+")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        cpu, previous = hal.get("cpu"), torch.get_num_threads()
        torch.set_num_threads(1)            # tiny models: threads only contend with the two ranks
        try:
            reference = {job.name: tp_worker.run_job(job, cpu, ParallelState())
                         for job in tp_worker.jobs() if job.compare is not None}
        finally:
            torch.set_num_threads(previous)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    assert proc.returncode == 0, log.read()[-8000:]
    return json.loads(out.read_text()), reference


def test_two_gloo_ranks_give_the_tp1_tokens(tp2_and_tp1_tokens):
    tp2_tokens, reference = tp2_and_tp1_tokens
    case = golden_case("ouro-tiny")                    # `torchrun -m runtime.generate ... parallel.tp=2`
    assert tp2_tokens["cli:ouro-tiny"] == [case.greedy(i) for i in range(case.num_prompts)]
    for job in tp_worker.jobs():
        tokens = tp2_tokens[job.name]
        if job.compare is None:                        # golden cases: the golden greedy is the tp=1 output
            case = golden_case(job.name.split(":")[-1])
            assert tokens == [case.greedy(i) for i in range(len(job.requests))], job.name
            continue
        for i, (ours, ref, compare) in enumerate(zip(tokens, reference[job.name], job.compare)):
            assert len(ours) == len(ref), (job.name, i)
            if compare:
                assert ours == ref, (job.name, i)


def test_tp_needs_torchrun_and_matching_world_size():
    cpu = hal.get("cpu")
    assert not init_distributed(cpu, 1, environ={}).is_parallel
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        init_distributed(cpu, 2, environ={})
    with pytest.raises(ValueError, match="WORLD_SIZE=4 processes but parallel.tp=2"):
        init_distributed(cpu, 2, environ={"RANK": "0", "WORLD_SIZE": "4"})
