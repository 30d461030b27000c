"""Never hang: a request that can never fit is refused at admission, the context is capped to what
the KV cache holds at engine start, and no configuration preempts a request forever (the scheduler
is driven through every admission path on random workloads until everything finishes)."""
from __future__ import annotations

import logging
import random
import threading

import pytest

import hal
import zoo
from helpers import golden_case, single_thread  # noqa: F401 (fixture)
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.kv_cache import BlockManager
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.planes import PlaneLayout
from runtime.engine.prefix_cache import PrefixPolicy
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.sequence import Request, RequestStatus

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_issue_hang_returns_with_an_error_for_the_request_that_cannot_fit():
    """12 blocks of 16 tokens, 5 KV planes (5 loops): a 27-token prompt with 24 new tokens needs 4
    blocks per plane, 20 in all. It used to be preempted and recomputed forever."""
    from runtime import LLM

    case = golden_case("ouro-tiny")
    llm = LLM(case.path, hal="cpu", dtype="float32", block_size=16, num_kv_blocks=12)
    prompts = [list(range(1, 28)), case.prompt(0), case.prompt(1)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_loops=5),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, num_loops=5),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    result = {}
    worker = threading.Thread(target=lambda: result.update(outs=llm.generate(prompts, params)), daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "LLM.generate hung"
    big, small, default = result["outs"]
    assert big.finish_reason == "error" and "lower max_tokens" in big.error and "5 x 4 blocks" in big.error
    assert len(small.token_ids) == 6 and small.finish_reason == "length"
    assert default.token_ids == case.greedy(1)[:6]


def test_token_ids_outside_the_vocabulary_are_refused_by_field():
    """The model can never sample such an id: a stop on it would silently never fire."""
    case = golden_case("ouro-tiny")
    engine = LLMEngine(zoo.from_pretrained(case.path, dtype="float32"), hal.get("cpu"), EngineConfig(num_kv_blocks=16))
    vocab = engine.model.config.vocab_size
    for field, params in (("stop_token_ids", SamplingParams(stop_token_ids=[vocab])),
                          ("logit_bias", SamplingParams(logit_bias={vocab: 1.0}))):
        with pytest.raises(ValueError, match=f"{field} names token ids outside the vocabulary of {vocab}"):
            engine.add_request(field, [1, 2, 3], params)
    assert not engine.has_unfinished_requests()


def test_max_model_len_is_capped_to_the_cache_at_start(caplog):
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    with caplog.at_level(logging.WARNING, "runtime.engine.llm_engine"):
        engine = LLMEngine(model, hal.get("cpu"), EngineConfig(block_size=4, num_kv_blocks=24))
    # 24 // 4 planes * 4 KV positions, and the last token, which is never computed
    assert engine.max_model_len == 25 and "max_model_len capped from" in caplog.text
    with pytest.raises(ValueError, match=r"engine.max_model_len=100 does not fit.*engine.max_model_len=25"):
        LLMEngine(model, hal.get("cpu"), EngineConfig(block_size=4, num_kv_blocks=24, max_model_len=100))
    with pytest.raises(ValueError, match=r"engine.max_model_len=100000 is longer than the model's 256 positions"):
        LLMEngine(model, hal.get("cpu"), EngineConfig(max_model_len=100000))
    with pytest.raises(ValueError, match="nothing can run.*engine.num_kv_blocks"):
        LLMEngine(model, hal.get("cpu"), EngineConfig(block_size=4, num_kv_blocks=3))
    with pytest.raises(ValueError, match="num_loops=80 is above the limit of 64 loops"):
        engine.add_request("deep", [1, 2], SamplingParams(num_loops=80))


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}, {"speculative": {"num_tokens": 2}}],
                         ids=["sync", "async", "speculation"])
def test_a_request_that_exactly_fills_the_cache_runs(options, single_thread):
    """Prompt + max_tokens = 9 tokens hold 8 positions of KV (the last token is never computed):
    2 blocks of 4 per plane, the whole cache. It runs, with the tokens of a large cache."""
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    planes = model.default_num_loops + model.kv_spec.num_fixed_planes
    prompt, params = list(range(1, 7)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outputs = []
    for num_blocks in (100, 2 * planes):
        config = EngineConfig(block_size=4, num_kv_blocks=num_blocks, **options)
        engine = LLMEngine(model, hal.get("cpu"), config)
        engine.add_request("a", prompt, params)
        outputs.append(engine.run_until_done()[0].token_ids)
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len(outputs[1]) == 3 and outputs[1] == outputs[0]
    assert engine.max_model_len == 9


@pytest.mark.parametrize("bad,setting", [
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
    (dict(num_kv_blocks=0), "num_kv_blocks"), (dict(block_size=0), "block_size"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(watermark_blocks=-2), "watermark_blocks"),
    (dict(max_model_len=1), "max_model_len"), (dict(max_num_loops=0), "max_num_loops"),
    (dict(kv_mode="half"), "kv_mode"), (dict(kv_dtype="fp4"), "kv_dtype"),
    (dict(preemption_mode="drop"), "preemption_mode"), (dict(scheduling_policy="lifo"), "scheduling_policy"),
    (dict(speculative=dict(num_tokens=-1)), "speculative.num_tokens")])
def test_every_bad_engine_value_names_its_setting(bad, setting):
    with pytest.raises(ValueError) as info:
        EngineConfig(**bad)
    assert str(info.value).startswith(setting), info.value


# ----- the scheduler on random workloads ---------------------------------------------------------
def simulate(rng: random.Random, case: int) -> None:
    block_size = rng.choice([2, 4])
    num_blocks = rng.randrange(6, 40)
    policy = rng.choice(["fcfs", "priority"])
    preemption = rng.choice(["recompute", "swap"])
    prefix = rng.random() < 0.4
    wavefront = rng.random() < 0.3
    config = SchedulerConfig(max_num_seqs=rng.randrange(1, 6), max_num_batched_tokens=rng.randrange(2, 24),
                             watermark_blocks=rng.choice([0, 0, 1, 3]), policy=policy, preemption_mode=preemption,
                             max_swap_blocks=rng.randrange(0, 12), wavefront=wavefront)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(config, blocks, PrefixPolicy(block_size, PlaneLayout("full", 0)))
    shared_prefix = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
    pending, forks = [], {}
    for i in range(rng.randrange(1, 10)):
        loops = rng.randrange(1, 4)
        prompt = (shared_prefix if rng.random() < 0.5 else []) + [rng.randrange(1, 50)
                                                                   for _ in range(rng.randrange(1, 12))]
        request = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 12)), num_loops=loops,
                          exit_threshold=1.0, num_planes=loops, max_seq_len=rng.choice([1 << 30, len(prompt) + 3]),
                          priority=rng.randrange(3), cache_salt=b"s" if prefix else None)
        pending.append((rng.randrange(0, 30), request, rng.choice([1, 1, 3])))
    pending.sort(key=lambda p: p[0])
    everyone = []
    for step in range(3000):
        while pending and pending[0][0] <= step:
            _, request, n = pending.pop(0)
            fits = blocks.fits_at_all(request.num_planes, Scheduler.max_request_tokens(request))
            try:
                sched.add(request)
            except MemoryError:
                assert not fits
                continue
            assert fits
            everyone.append(request)
            forks[request.request_id] = n - 1
        if not pending and all(r.is_finished for r in everyone):
            return
        out = sched.schedule()
        assert out.scheduled or sched.running or not sched.waiting, \
            f"case {case}: idle with requests waiting: {[r.request_id for r in sched.waiting]}"
        sampling = [i.request for i in out.scheduled if i.samples]
        sched.advance(out.scheduled)
        for request in sampling:
            request.append_token(rng.randrange(1, 50), request.num_loops)
            if forks.get(request.request_id) and len(request.output_token_ids) == 1:
                for j in range(forks.pop(request.request_id)):       # n > 1: samples share its prompt
                    child = Request(f"{request.request_id}#{j}", list(request.prompt_token_ids), request.params,
                                    request.num_loops, 1.0, request.num_planes, max_seq_len=request.max_seq_len,
                                    priority=request.priority, cache_salt=request.cache_salt)
                    sched.fork(request, child)
                    everyone.append(child)
            sched.cache_blocks(request)
            status = request.check_stop()
            if status is not None:
                sched.finish(request, status)
        blocks.check_invariants()
    raise AssertionError(f"case {case}: not finished after 3000 steps: "
                         f"{[(r.request_id, r.status, r.metrics.num_preemptions) for r in everyone if not r.is_finished]}")


@pytest.mark.parametrize("chunk", range(4))
def test_no_workload_preempts_a_request_forever(chunk):
    for case in range(chunk * 75, (chunk + 1) * 75):
        simulate(random.Random(case), case)


def test_a_waiting_fork_gives_its_blocks_back_under_pressure():
    blocks = BlockManager(8, 2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32, policy="priority"), blocks)
    parent = Request("p", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), 1, 1.0, 1)
    sched.add(parent)
    sched.advance(sched.schedule().scheduled)
    parent.append_token(9, 1)
    child = Request("p#1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), 1, 1.0, 1)
    sched.fork(parent, child)                  # shares the parent's 2 full blocks of the 5-token prompt
    assert child.num_computed_tokens == 4 and blocks.block_tables("p#1") == [blocks.block_tables("p")[0][:2]]
    sched.finish(parent, RequestStatus.FINISHED_LENGTH)
    urgent = Request("u", list(range(1, 16)), SamplingParams(max_tokens=1), 1, 1.0, 1, priority=-1)
    sched.add(urgent)                          # needs all 8 blocks; the queued fork holds 2
    out = sched.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["u"] and child.num_computed_tokens == 0
    blocks.check_invariants()
