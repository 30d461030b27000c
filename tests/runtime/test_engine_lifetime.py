"""An engine is freed when its last reference goes, without Python's cycle collector: a cycle through
the runner (a captured program that closes over it) would keep its graphs and KV pool until some
later collection, which on CUDA may run in the middle of another engine's graph capture and destroy
graphs there (CUDA then invalidates that capture)."""
import gc
import weakref

import pytest

import hal
import zoo
from helpers import golden_case
from runtime import SamplingParams
from runtime.config import EngineConfig, SpeculativeConfig
from runtime.engine.llm_engine import LLMEngine

CONFIGS = {
    "plain": {},
    "async-scheduling": {"async_scheduling": True},
    "speculation-sync": {"speculative": SpeculativeConfig(3, 2, "sync")},
    "speculation-sync-per-pass": {"speculative": SpeculativeConfig(3, 2, "sync", fuse_round=False)},
    "speculation-async": {"speculative": SpeculativeConfig(3, 2, "async")},
}


@pytest.fixture(scope="module")
def ouro():
    case = golden_case("ouro-tiny")
    return case, zoo.from_pretrained(case.path, dtype="float32")


@pytest.mark.parametrize("name", CONFIGS)
def test_an_engine_is_freed_without_the_cycle_collector(ouro, name):
    case, model = ouro
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=4, max_model_len=128, graphs=True,
                                                           **CONFIGS[name]))
    for i in range(2):
        engine.add_request(str(i), case.prompt(i), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    outs = engine.run_until_done()
    assert len(outs) == 2 and all(len(o.token_ids) == 8 for o in outs)
    assert engine.runner.graphs is not None and engine.runner.graphs.captured     # the programs are kept
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        runner, blocks = weakref.ref(engine.runner), weakref.ref(engine.blocks)
        del engine, outs
        assert runner() is None and blocks() is None
    finally:
        if was_enabled:
            gc.enable()


def test_overlapping_captures_keep_the_collector_paused_until_the_last_ends():
    """Tensor-parallel ranks in threads capture at the same time: the first capture to end must not
    turn the collector back on under the other, and the last restores what the first found."""
    from hal.common.graph import cycle_collector_paused

    assert gc.isenabled()
    first, second = cycle_collector_paused(), cycle_collector_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:
        with cycle_collector_paused():
            pass
        assert not gc.isenabled()        # off before: left off
    finally:
        gc.enable()
