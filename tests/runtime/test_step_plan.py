"""Step plans (runtime.parallel.step_plan): a follower that only sees rank 0's plans runs exactly rank 0's
steps (same batches, block ids, KV moves, sampled tokens) through preemption (recompute and swap),
chunked and wavefront prefill, prefix caching, early exit, seeded sampling and speculation rounds;
it notices when its tokens differ; what it cannot replay is refused. In-process, without collectives."""
import pickle

import pytest
import torch

import hal
import zoo
from helpers import golden_case, single_thread  # noqa: F401 (fixture)
from runtime import SamplingParams
from runtime.config import EngineConfig, SpeculativeConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.parallel.follower import Follower, TensorParallelMismatch
from runtime.parallel.step_plan import PlanPublisher, StepPlan
from test_speculation import damp_loops

CPU = hal.get("cpu")
pytestmark = pytest.mark.usefixtures("single_thread")


class DirectChannel:
    """Delivers each message, pickled as it would cross the wire, straight to a follower."""

    def __init__(self, follower: Follower) -> None:
        self.follower, self.plan_bytes = follower, []
        self.num_swaps = self.num_wave_items = self.num_draft_items = self.num_table_resets = 0

    def send(self, message) -> None:
        payload = pickle.dumps(message)
        if isinstance(message, StepPlan):
            self.plan_bytes.append(len(payload))
            self.num_swaps += len(message.swap_out) + len(message.swap_in)
            self.num_wave_items += sum(item.is_wave for item in message.items)
            self.num_draft_items += sum(item.num_draft_tokens > 0 for item in message.items)
            self.num_table_resets += sum(item.reset_tables for item in message.items)
        self.follower.handle(pickle.loads(payload))


TINY_OURO = {"model_type": "ouro", "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "total_ut_steps": 3, "max_position_embeddings": 64, "rope_theta": 10000.0,
             "initializer_range": 0.3}


def run_pair(build, requests, **config):
    """Rank 0's engine on `build()`, a follower on another `build()`; the outputs, channel, follower."""
    follower = Follower(build(), CPU, None)
    channel = DirectChannel(follower)
    config = EngineConfig(**{"max_num_seqs": 4, **config})
    engine = LLMEngine(build(), CPU, config, publisher=PlanPublisher(channel))
    assert follower.runner is not None and follower.runner.num_blocks == engine.runner.num_blocks
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert follower.num_steps == engine.num_steps
    # every token but those of a request's last step (no plan follows them) matched the follower's
    last_step = 1 + config.speculative.num_tokens
    assert follower.num_checked_tokens >= sum(len(o.token_ids) for o in outs.values()) - last_step * len(outs)
    engine.close()
    assert follower.runner is None
    return [outs[str(i)] for i in range(len(requests))], channel


def tiny_ouro(seed):
    return lambda: zoo.from_config(TINY_OURO, dtype="float32", seed=seed)


def random_prompts(n, vocab=61):
    return [torch.randint(1, vocab, (int(torch.randint(3, 12, ())),)).tolist() for _ in range(n)]


def test_follower_runs_rank0_steps_through_preemption_chunked_prefill_and_early_exit():
    seed = int(torch.randint(1 << 20, ()))
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.5)]
    requests = [(p, params[i % 2]) for i, p in enumerate(random_prompts(4))]
    # 3 planes x 5 blocks of 4 tokens hold one request and a bit: the scheduler must preempt
    outs, channel = run_pair(tiny_ouro(seed), requests, block_size=4, num_kv_blocks=18,
                             max_num_batched_tokens=7)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert all(len(o.token_ids) == 8 for o in outs)      # the follower checked every token against rank 0's
    print(f"plans: {len(channel.plan_bytes)}, smallest {min(channel.plan_bytes)} bytes, "
          f"largest {max(channel.plan_bytes)}")
    assert min(channel.plan_bytes) < 400


def test_early_exit_decisions_agree_in_last_exited_mode():
    seed = int(torch.randint(1 << 20, ()))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.3)
    outs, _ = run_pair(tiny_ouro(seed), [(p, params) for p in random_prompts(2)], kv_mode="last_exited",
                       block_size=4)
    assert all(len(o.token_ids) == 6 for o in outs)


def test_swap_preemption_prefix_cache_and_wavefront_prefill_replay_on_the_follower():
    seed = int(torch.randint(1 << 20, ()))
    shared = random_prompts(1)[0] + random_prompts(1)[0]                    # a common prefix: cache hits
    prompts = [shared + p for p in random_prompts(3)] + [random_prompts(1)[0] * 3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs, channel = run_pair(tiny_ouro(seed), [(p, params) for p in prompts], block_size=4, num_kv_blocks=40,
                             max_num_batched_tokens=8, preemption_mode="swap", enable_prefix_caching=True,
                             wavefront_prefill=True)
    assert all(len(o.token_ids) == 8 for o in outs)                 # every token checked against rank 0's
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert channel.num_swaps > 0 and channel.num_wave_items > 0


def test_seeded_sampling_and_random_initial_states_agree_on_the_follower():
    case = golden_case("huginn-tiny")
    seeded = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=int(torch.randint(1 << 30, ())),
                            init_scale=1.0, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=6, temperature=1.0, init_scale=1.0, ignore_eos=True, num_loops=2)
    requests = [(case.prompt(0), seeded), (case.prompt(1), unseeded)]
    outs, _ = run_pair(lambda: zoo.from_pretrained(case.path, dtype="float32"), requests, block_size=4,
                       max_num_batched_tokens=5)
    assert all(len(o.token_ids) == 6 for o in outs)


def test_a_seeded_publisher_gives_unseeded_requests_reproducible_seeds():
    """LLM(seed=S, parallel=...): the driver draws unseeded requests' seeds from S, so a
    tensor-parallel run samples alike run to run; without S they come from the OS."""
    from runtime.parallel.state import ParallelState

    unseeded, own = SamplingParams(), SamplingParams(seed=5)
    draws = lambda publisher: [publisher.seeded(unseeded).seed for _ in range(3)]   # noqa: E731
    first = draws(ParallelState(0, 2, channel=object()).publisher(seed=11))
    assert first == draws(PlanPublisher(None, seed=11)) and len(set(first)) == 3
    assert draws(PlanPublisher(None, seed=12)) != first
    assert draws(PlanPublisher(None)) != draws(PlanPublisher(None))
    assert all(0 <= s < 2 ** 63 for s in first) and PlanPublisher(None, seed=11).seeded(own).seed == 5


def test_speculation_rounds_replay_on_the_follower():
    seed = int(torch.randint(1 << 20, ()))
    build = lambda: damp_loops(zoo.from_config(TINY_OURO, dtype="float32", seed=seed), 0.3)  # noqa: E731
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True)       # seeded by the driver
    prompts = random_prompts(4)
    requests = [(p, greedy if i % 2 else sampled) for i, p in enumerate(prompts)]
    spec = SpeculativeConfig(num_tokens=3, draft_loops=1)
    outs, channel = run_pair(build, requests, block_size=2, max_num_batched_tokens=9, speculative=spec)
    assert all(len(o.token_ids) == 12 for o in outs)        # every round's tokens checked against rank 0's
    assert channel.num_draft_items > 0 and channel.num_table_resets > len(requests)   # trims after rejections
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    print(f"drafted {drafted}, accepted {sum(o.metrics.num_accepted_tokens for o in outs)}, "
          f"draft items {channel.num_draft_items}, table resets {channel.num_table_resets}")
    assert 0 < sum(o.metrics.num_accepted_tokens for o in outs) < drafted
    plain = LLMEngine(build(), CPU, EngineConfig(max_num_seqs=4, block_size=2))
    for i, (prompt, params) in enumerate(requests[1::2]):
        plain.add_request(str(i), prompt, params)
    assert [o.token_ids for o in sorted(plain.run_until_done(), key=lambda o: int(o.request_id))] == \
        [o.token_ids for o in outs[1::2]]


@pytest.mark.parametrize("config, fix", [
    ({"async_scheduling": True}, "engine.async_scheduling=false"),
    ({"speculative": SpeculativeConfig(2, 1, "async")}, "engine.speculative.mode=sync")])
def test_what_followers_cannot_replay_is_refused(config, fix):
    follower = Follower(zoo.from_config(TINY_OURO, dtype="float32", seed=1), CPU, None)
    with pytest.raises(ValueError, match=f"not implemented with tensor parallelism.*set {fix}"):
        LLMEngine(zoo.from_config(TINY_OURO, dtype="float32", seed=1), CPU, EngineConfig(**config),
                  publisher=PlanPublisher(DirectChannel(follower)))
    assert follower.runner is None                          # refused before the followers built anything


def test_a_follower_with_other_logits_is_caught():
    seed = int(torch.randint(1 << 20, ()))
    models = iter([zoo.from_config(TINY_OURO, dtype="float32", seed=seed),
                   zoo.from_config(TINY_OURO, dtype="float32", seed=seed + 1)])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with pytest.raises(TensorParallelMismatch, match="rank 0 sampled token"):
        run_pair(lambda: next(models), [(p, params) for p in random_prompts(3)], block_size=4)
