"""Tensor parallelism end to end: two processes on gloo, launched by torchrun, give the tp=1 greedy
tokens on every golden case (all have 4 query heads and 4 or 2 KV heads, so tp=2 divides them), with
chunked prefill and preemption; and the tp=1 tokens for KV heads replicated across ranks, early exit
with skipped planes, and seeded sampling with Huginn's random initial states."""
import json
import os
import subprocess
import sys

import pytest

import hal
from helpers import ROOT, golden_case
from runtime.parallel import ParallelState, init_distributed

WORKER = ROOT / "tests" / "runtime" / "tp_worker.py"
sys.path.insert(0, str(WORKER.parent))
import tp_worker  # noqa: E402


@pytest.fixture(scope="module")
def tp2_tokens(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "tokens.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(WORKER), str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_two_gloo_ranks_give_the_tp1_tokens(tp2_tokens):
    cpu = hal.get("cpu")
    case = golden_case("ouro-tiny")                    # `torchrun -m runtime.generate ... parallel.tp=2`
    assert tp2_tokens["cli:ouro-tiny"] == [case.greedy(i) for i in range(case.num_prompts)]
    for job in tp_worker.jobs():
        tokens = tp2_tokens[job.name]
        if job.compare is None:                        # golden cases: the golden greedy is the tp=1 output
            case = golden_case(job.name.split(":")[-1])
            assert tokens == [case.greedy(i) for i in range(len(job.requests))], job.name
            continue
        reference = tp_worker.run_job(job, cpu, ParallelState())
        for i, (ours, ref, compare) in enumerate(zip(tokens, reference, job.compare)):
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
