"""The engine on the simulated Ascend Hal reproduces every golden case's greedy tokens: fused attention
(the 910B's shape limits lifted for the tiny models, pages of 16 so tables span blocks), chunked packed
prefill run eagerly, and decode replayed from per-bucket graphs with a host update before every replay.
A missing or stale update is caught. Shapes the fused op cannot take run eagerly on the fallback."""
import collections

import pytest
from helpers import golden_case, golden_names, single_thread  # noqa: F401 (fixture)

import hal
import zoo
from hal.ascend.graph import SimGraph
from hal.ascend.sim.npu import GraphReplayError
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine


def sim_engine(model, any_shape=True, **config):
    h = hal.get("ascend-sim", sim_any_shape=any_shape)
    # 3 prompts, a budget of 8 tokens a step: prefill is chunked and overlaps the first decodes, so
    # requests finish apart and decode batches of 3 (padded to bucket 4), 2 and 1 all occur
    defaults = dict(block_size=16 if any_shape else None, max_num_batched_tokens=8, max_num_seqs=4)
    return LLMEngine(model, h, EngineConfig(**{**defaults, **config}))


def golden_params(case):
    return SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                          num_loops=case.meta.get("greedy_num_steps"), init_scale=0.0)


def generate(engine, case):
    for i in range(case.num_prompts):
        engine.add_request(str(i), case.prompt(i), golden_params(case))
    outputs = {o.request_id: o for o in engine.run_until_done()}
    return [outputs[str(i)].token_ids for i in range(case.num_prompts)]


@pytest.fixture
def graph_log(monkeypatch):
    """Per simulated graph: the number of host-param dicts each update gave, and the replays."""
    log = collections.defaultdict(lambda: {"updates": [], "replays": 0})
    update, replay = SimGraph.update, SimGraph.replay

    def counted_update(self, host_params):
        log[self]["updates"].append(len(host_params))
        update(self, host_params)

    def counted_replay(self):
        log[self]["replays"] += 1
        replay(self)

    monkeypatch.setattr(SimGraph, "update", counted_update)
    monkeypatch.setattr(SimGraph, "replay", counted_replay)
    return log


@pytest.mark.parametrize("name", golden_names())
def test_golden_greedy_with_decode_graphs(name, graph_log, single_thread):
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    engine = sim_engine(model, graphs=True)
    assert engine.runner.backend.name == "fia"
    got = generate(engine, case)
    assert got == [case.greedy(i) for i in range(case.num_prompts)]

    captured = engine.runner.graphs.captured              # ("decode", bucket, loops, copy) -> capture
    # every bucket was captured at start (engine.capture_at_start); these batch sizes replayed theirs
    assert {bucket for _, bucket, _, _ in captured} == {1, 2, 4}
    wanted_buckets = {4, 2, 1} if case.num_prompts == 3 else {2, 1}
    num_replays, replayed = 0, set()
    for (_, bucket, _, _), cap in captured.items():
        calls, log = cap.graph.calls, graph_log[cap.graph]
        planes = len(cap.ctx.batch.block_tables)
        assert calls and {c.plane for c in calls} == set(range(planes)), (bucket, calls)
        assert {c.site for c in calls} == {"fused_infer_attention"}
        # every replay came right after its own update of every captured attention call
        assert log["updates"] == [len(calls)] * log["replays"], (bucket, log)
        num_replays += log["replays"]
        replayed |= {bucket} if log["replays"] else set()
    assert replayed == wanted_buckets
    # most decode steps ran from graphs (those overlapping a prefill chunk run eagerly)
    assert num_replays >= case.meta["greedy_new_tokens"] - 1, num_replays
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def _broken_engine(monkeypatch, fault):
    case = golden_case("ouro-tiny")
    engine = sim_engine(zoo.from_pretrained(case.path, dtype="float32").eval(), graphs=True)
    backend = engine.runner.backend
    update_meta, first = backend.update_meta, {}

    def faulty_update_meta(meta, batch):
        params = update_meta(meta, batch)
        if fault == "no params":
            return []
        if fault == "stale params":                     # the lengths of the graph's first replay, forever
            return first.setdefault(id(meta), params) if params else params
        return params

    monkeypatch.setattr(backend, "update_meta", faulty_update_meta)
    if fault == "no update":
        monkeypatch.setattr(SimGraph, "update", lambda self, host_params: None)
    return engine, case


@pytest.mark.parametrize("fault, error", [
    ("no params", "got 0 host-param dicts; the graph captured 8"),
    ("no update", "replay without update"),
])
def test_missing_update_fails_loudly(monkeypatch, single_thread, fault, error):
    engine, case = _broken_engine(monkeypatch, fault)
    with pytest.raises((ValueError, GraphReplayError), match=error):
        generate(engine, case)


def test_stale_update_gives_wrong_tokens(monkeypatch, single_thread):
    """The replay attends over the lengths the update gave, as on the NPU, not those in the meta."""
    engine, case = _broken_engine(monkeypatch, "stale params")
    assert generate(engine, case) != [case.greedy(i) for i in range(case.num_prompts)]


def test_fallback_backend_runs_eagerly(single_thread):
    """With the 910B's limits (head dim 128, fp16/bf16) the tiny model goes to the torch fallback:
    no graphs (graphs=true is refused by name), the eager path, still the golden tokens."""
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    with pytest.raises(ValueError, match="graphs=true, but attention backend 'torch' cannot be captured"):
        sim_engine(model, any_shape=False, graphs=True)
    engine = sim_engine(model, any_shape=False)
    assert engine.runner.backend.name == "torch" and engine.runner.graphs is None
    assert "head dim 16" in engine.runner.backend.caps.reason
    assert generate(engine, case) == [case.greedy(i) for i in range(case.num_prompts)]


def test_speculation_rounds_in_one_graph_with_host_updates(graph_log, single_thread):
    """Sync greedy speculation on the simulated NPU: fused attention bakes lengths on the host, so a
    round's chain has every pass's metadata filled by the host (no device advance), and each replay
    follows one update that carries the host params of every pass, in capture order: golden tokens."""
    from runtime.config import SpeculativeConfig

    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    engine = sim_engine(model, graphs=True, max_num_batched_tokens=16, speculative=SpeculativeConfig(3, 2))
    assert generate(engine, case) == [case.greedy(i) for i in range(case.num_prompts)]
    chains = engine.runner.graphs.chains
    assert engine.speculator.advances is False and chains
    for chain in chains.values():
        log = graph_log[chain.graph]
        assert len(chain.ctxs) == 3 + 2                     # K + 1 draft passes and the verify, each its own meta
        assert log["replays"] >= 1 and log["updates"] == [len(chain.graph.calls)] * log["replays"]
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_an_engine_built_under_inference_mode_runs(single_thread):
    """A tensor-parallel follower builds its engine under `torch.inference_mode()` (runtime/llm.py);
    the fused attention's mask must not be an inference tensor the simulator cannot version-check,
    and the simulator's check must take one anyway."""
    import torch

    from hal.ascend.sim.attention import causal_mask_ok

    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    with torch.inference_mode():
        engine = sim_engine(model)
        assert not engine.runner.backend.mask.is_inference()
        assert generate(engine, case) == [case.greedy(i) for i in range(case.num_prompts)]
        mask = torch.ones(2048, 2048, dtype=torch.bool).triu_(1)
    assert mask.is_inference() and causal_mask_ok(mask) and causal_mask_ok(mask)
    with torch.inference_mode():
        mask[0, 1] = False                   # changed in place: seen, as no version says otherwise
    assert not causal_mask_ok(mask)
