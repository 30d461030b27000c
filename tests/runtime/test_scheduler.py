"""Scheduling decisions: token budget, decode first, chunked prefill, FIFO admission, preemption."""
import pytest

from runtime.sampling_params import SamplingParams
from runtime.engine.kv_cache import BlockManager
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.sequence import Request, RequestStatus


def make(rid, prompt_len, planes=2, max_tokens=100):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), num_loops=planes,
                   exit_threshold=1.0, num_planes=planes)


def advance(out):
    """What the engine does after a step: tokens computed, sampled rows get a token."""
    for item in out.scheduled:
        item.request.num_computed_tokens += item.num_tokens
        if item.request.num_uncomputed_tokens == 0:
            item.request.append_token(7, 2)


def test_chunked_prefill_never_stalls_decodes():
    bm = BlockManager(100, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), bm)
    a = make("a", 3)
    s.add(a)
    advance(s.schedule())                       # a prefills 3 tokens, samples
    b = make("b", 25)
    s.add(b)
    out = s.schedule()
    counts = {i.request.request_id: i.num_tokens for i in out.scheduled}
    assert counts == {"a": 1, "b": 9}           # a decodes; b gets the rest of the budget
    assert [i.samples for i in out.scheduled] == [True, False]
    advance(out)
    out = s.schedule()
    assert {i.request.request_id: i.num_tokens for i in out.scheduled} == {"a": 1, "b": 9}
    advance(out)
    out = s.schedule()
    assert {i.request.request_id: i.num_tokens for i in out.scheduled} == {"a": 1, "b": 7}
    assert out.scheduled[1].samples


def test_fifo_admission_and_max_num_seqs():
    bm = BlockManager(100, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), bm)
    for rid in "abc":
        s.add(make(rid, 4))
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["a", "b"] and len(s.waiting) == 1


def test_preempts_the_newest_when_blocks_run_out_and_recomputes():
    bm = BlockManager(6, 4)                      # 2 planes per request
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    a, b = make("a", 4, max_tokens=8), make("b", 4, max_tokens=8)
    s.add(a)
    s.add(b)
    advance(s.schedule())                       # a, b: 1 block per plane each; 2 free
    out = s.schedule()                          # both decode at position 4: a takes the last 2 blocks
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and out.preempted == [b]
    assert b.metrics.num_preemptions == 1 and s.waiting[0] is b
    assert [i.request.request_id for i in out.scheduled] == ["a"]
    bm.check_invariants()


def test_request_larger_than_the_cache_is_rejected_alone():
    bm = BlockManager(4, 4)
    s = Scheduler(SchedulerConfig(), bm)
    with pytest.raises(MemoryError, match="more than the whole cache"):
        s.add(make("big", 20, max_tokens=1))
    with pytest.raises(MemoryError, match="lower max_tokens"):       # the prompt fits, its answer would not
        s.add(make("long answer", 3, max_tokens=7))
    s.add(make("ok", 3, max_tokens=6))          # 9 tokens: 8 of KV (the last is never computed), the whole cache
    assert len(s.waiting) == 1


# ----- priority, swap, wavefront, async bookkeeping ------------------------------------------
def make_p(rid, prompt_len, priority, planes=2, loops=None, max_tokens=100):
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                num_loops=loops or planes, exit_threshold=1.0, num_planes=planes)
    r.priority = priority
    return r


def test_priority_queue_orders_by_level_then_arrival():
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100, policy="priority"),
                  BlockManager(100, 4))
    for rid, prio in (("a", 2), ("b", 1), ("c", 2), ("d", 0), ("e", 1)):
        s.add(make_p(rid, 4, prio))
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["d", "b", "e"]
    assert [r.request_id for r in s.waiting] == ["a", "c"]


def test_fcfs_ignores_priority():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), BlockManager(100, 4))
    for rid, prio in (("a", 2), ("b", 0), ("c", -5)):
        s.add(make_p(rid, 4, prio))
    assert [i.request.request_id for i in s.schedule().scheduled] == ["a", "b"]


def test_urgent_arrival_preempts_the_least_urgent_running_request():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, policy="priority"),
                  BlockManager(100, 4))
    low1, low2 = make_p("low1", 4, 5), make_p("low2", 4, 5)
    s.add(low1)
    s.add(low2)
    advance(s.schedule())
    mid = make_p("mid", 4, 5)                  # same level: waits for a slot, preempts nobody
    s.add(mid)
    out = s.schedule()
    assert not out.preempted and {i.request.request_id for i in out.scheduled} == {"low1", "low2"}
    advance(out)
    high = make_p("high", 4, 0)
    s.add(high)
    out = s.schedule()
    assert out.preempted == [low2] and low2.num_computed_tokens == 0       # newest of the lowest level
    assert [i.request.request_id for i in out.scheduled] == ["low1", "high"]
    assert [r.request_id for r in s.waiting] == ["low2", "mid"]            # FCFS within the level
    s.blocks.check_invariants()


def test_swap_preemption_keeps_computed_tokens_and_returns_the_same_block_count():
    bm = BlockManager(6, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap",
                                  max_swap_blocks=8), bm)
    a, b = make("a", 4, max_tokens=8), make("b", 4, max_tokens=8)
    s.add(a)
    s.add(b)
    advance(s.schedule())
    out = s.schedule()                          # a grows: b is swapped out, not dropped
    assert out.preempted == [b] and b.num_computed_tokens == 4 and s.swapped == {"b": 1}
    assert len(out.swap_out) == 1 and len(out.swap_out[0].blocks) == 2
    advance(out)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["b"] and out.scheduled[0].num_tokens == 1
    assert len(out.swap_in) == 1 and out.swap_in[0].blocks == [t[0] for t in bm.block_tables("b")]
    assert not s.swapped and s.num_swapped_blocks == 0
    bm.check_invariants()


def test_swap_space_exhausted_falls_back_to_recompute():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap",
                                  max_swap_blocks=1), BlockManager(6, 4))
    a, b = make("a", 4, max_tokens=8), make("b", 4, max_tokens=8)
    s.add(a)
    s.add(b)
    advance(s.schedule())
    out = s.schedule()
    assert out.preempted == [b] and not out.swap_out and b.num_computed_tokens == 0


def engine_advance(s, out):
    """What the engine does after a step, wavefront chunks included."""
    sampling = [i.request for i in out.scheduled if i.samples]
    s.advance(out.scheduled)
    for request in sampling:
        request.append_token(7, request.num_loops)


def test_wavefront_chunks_run_one_loop_per_step_and_sample_after_the_last():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, wavefront=True),
                  BlockManager(100, 2))
    r = make_p("w", 10, 0, planes=3, loops=3, max_tokens=50)
    s.add(r)
    steps = []
    while not r.output_token_ids:
        out = s.schedule()
        assert all(i.is_wave for i in out.scheduled)
        steps.append(sorted((i.first_token, i.num_tokens, i.depth, i.samples) for i in out.scheduled))
        assert sum(i.num_new_tokens for i in out.scheduled) <= 4
        engine_advance(s, out)
    # chunk i at loop k runs with chunk i+1 at loop k-1; the sample comes with the last chunk's last loop
    assert steps == [[(0, 4, 0, False)],
                     [(0, 4, 1, False), (4, 4, 0, False)],
                     [(0, 4, 2, False), (4, 4, 1, False), (8, 2, 0, False)],
                     [(4, 4, 2, False), (8, 2, 1, False)],
                     [(8, 2, 2, True)]]
    assert r.num_computed_tokens == 10 and not r.wave_chunks and not r.is_prefill
    out = s.schedule()                                       # then it decodes normally
    assert [(i.num_tokens, i.is_wave) for i in out.scheduled] == [(1, False)]


def test_a_prompt_that_fits_the_budget_is_not_a_wavefront():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, wavefront=True), BlockManager(100, 2))
    s.add(make_p("w", 10, 0, planes=3, loops=3, max_tokens=50))
    assert [(i.num_tokens, i.is_wave) for i in s.schedule().scheduled] == [(10, False)]


def test_async_placeholders_cap_scheduling_at_max_tokens():
    from runtime.engine.sequence import PLACEHOLDER

    s = Scheduler(SchedulerConfig(), BlockManager(100, 4))
    r = make_p("a", 3, 0, max_tokens=2)
    s.add(r)
    for _ in range(2):                           # prefill, then one decode, each leaves a placeholder
        out = s.schedule()
        assert [i.request for i in out.scheduled] == [r]
        s.advance(out.scheduled)
        r.append_token(PLACEHOLDER, 0)
    assert r.is_length_capped and s.schedule().is_empty     # a third step would be wasted work
    assert r.resolve_token(11, 2) == 1 and r.check_stop(1) is None
    assert r.resolve_token(12, 2) == 2 and r.check_stop(2) == RequestStatus.FINISHED_LENGTH
