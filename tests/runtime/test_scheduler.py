"""Scheduling decisions: token budget, decode first, chunked prefill, FIFO admission, preemption."""
import pytest

from runtime.config import SamplingParams
from runtime.kv_cache import BlockManager
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.sequence import Request, RequestStatus


def make(rid, prompt_len, planes=2):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100), num_loops=planes,
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
    a, b = make("a", 4), make("b", 4)
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
        s.add(make("big", 20))
    s.add(make("ok", 3))
    assert len(s.waiting) == 1
