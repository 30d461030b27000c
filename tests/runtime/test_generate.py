"""The simple generation path reproduces the golden greedy continuations; sampling behaves."""
import dataclasses

import pytest
import torch

import hal
import zoo
from helpers import golden_case, golden_names, single_thread  # noqa: F401 (fixture)
from runtime import LLM, SamplingParams
from runtime.execution.sampler import filtered_probs, make_generator, sample_token

OURO = golden_names("ouro")
# loops and initial state of each golden greedy run, as SamplingParams fields
LOOPED = {"huginn-tiny": lambda meta: dict(num_loops=meta["greedy_num_steps"], init_scale=0.0),
          "nanbeige-tiny": lambda meta: dict()}


@pytest.mark.parametrize("name", OURO)
def test_llm_greedy_equals_golden(name):
    case = golden_case(name)
    llm = LLM(case.path, hal="cpu", dtype="float32")
    prompts = [case.prompt(i) for i in range(case.num_prompts)]
    n = case.meta["greedy_new_tokens"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.token_ids == case.greedy(i)
        assert out.finish_reason == "length" and out.prompt_token_ids == case.prompt(i)
        assert out.loops_per_token == [llm.model.config.total_ut_steps] * n


@pytest.mark.parametrize("name", sorted(LOOPED))
def test_llm_greedy_equals_golden_huginn_nanbeige(name):
    case = golden_case(name)
    llm = LLM(case.path, hal="cpu", dtype="float32")
    n = case.meta["greedy_new_tokens"]
    extra = LOOPED[name](case.meta)
    outs = llm.generate([case.prompt(i) for i in range(case.num_prompts)],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **extra))
    for i, out in enumerate(outs):
        assert out.token_ids == case.greedy(i)
        assert out.loops_per_token == [extra.get("num_loops", llm.model.default_num_loops)] * n


def test_huginn_random_state_follows_the_seed_even_when_greedy():
    case = golden_case("huginn-tiny")
    llm = LLM(case.path, hal="cpu", dtype="float32")
    assert make_generator(SamplingParams(temperature=0, seed=1), torch.device("cpu")) is not None
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True, num_loops=1, init_scale=20.0)
    run = lambda seed: llm.generate(case.prompt(2), SamplingParams(seed=seed, **greedy))[0].token_ids  # noqa: E731
    assert run(0) == run(0)
    assert len({tuple(run(seed)) for seed in range(4)}) > 1, "a large random initial state should change tokens"


def test_a_seeded_huginn_state_depends_on_nothing_but_seed_and_position(single_thread):
    """Huginn's random initial state of a seeded request is keyed by (seed, position): the tokens
    are the simple path's alone, beside another request (which moves its prompt's chunk
    boundaries) and after a recompute preemption (which computes its tokens again)."""
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine
    from runtime.execution.reference import generate_reference

    case = golden_case("huginn-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    params = [SamplingParams(max_tokens=10, temperature=0.0, seed=seed, ignore_eos=True, num_loops=4)
              for seed in (7, 8)]
    prompts = [case.prompt(1) * 2, case.prompt(0)]
    expected = [generate_reference(model, p, s)[0] for p, s in zip(prompts, params)]
    assert expected[0] != generate_reference(model, prompts[0], dataclasses.replace(params[0], seed=9))[0]

    def run(which, **config):
        engine = LLMEngine(model, hal.get("cpu"), EngineConfig(block_size=4, **config))
        for i in which:
            engine.add_request(str(i), prompts[i], params[i])
        outs = {o.request_id: o for o in engine.run_until_done()}
        return [outs[str(i)].token_ids for i in which], sum(o.metrics.num_preemptions for o in outs.values())

    assert run([0], num_kv_blocks=400, max_num_batched_tokens=16)[0] == expected[:1]
    assert run([1, 0], num_kv_blocks=400, max_num_batched_tokens=16)[0] == expected[::-1]
    tokens, num_preemptions = run([1, 0], num_kv_blocks=50, preemption_mode="recompute")
    assert num_preemptions > 0 and tokens == expected[::-1]


def test_stop_tokens_end_generation():
    case = golden_case("ouro-tiny")
    llm = LLM(case.path, hal="cpu", dtype="float32")
    greedy = case.greedy(0)
    stop = greedy[3]
    out = llm.generate(case.prompt(0), SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop],
                                                      ignore_eos=True))[0]
    assert out.token_ids == greedy[:greedy.index(stop) + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_varies():
    case = golden_case("ouro-tiny")
    llm = LLM(case.path, hal="cpu", dtype="float32")
    p = dict(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    a = llm.generate(case.prompt(1), SamplingParams(seed=7, **p))[0].token_ids
    b = llm.generate(case.prompt(1), SamplingParams(seed=7, **p))[0].token_ids
    c = llm.generate(case.prompt(1), SamplingParams(seed=8, **p))[0].token_ids
    assert a == b and a != c


def test_sampling_params_read_an_iterator_once_and_take_numpy_integers():
    import numpy as np

    params = SamplingParams(stop_token_ids=(t for t in [1, 2]), stop=(s for s in ["a"]),
                            logit_bias=((t, 1.0) for t in [3]), top_k=np.int64(5), seed=np.int64(9))
    assert (params.stop_token_ids, params.stop, params.logit_bias) == ((1, 2), ("a",), ((3, 1.0),))
    assert (params.top_k, params.seed) == (5, 9) and type(params.seed) is int


def test_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs[2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]            # the top token alone reaches 0.5 (p=0.64)
    assert sample_token(logits, SamplingParams(temperature=0)) == 0


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(num_loops=0),
                                 dict(exit_threshold=1.5), dict(init_scale=-0.5),
                                 # past what the persistent batch's int64 rows hold: refused here, not
                                 # failing the engine step of every request in the batch
                                 dict(top_k=2 ** 63), dict(stop_token_ids=[10 ** 23]), dict(stop_token_ids=[-1]),
                                 dict(seed=2 ** 64), dict(max_tokens=2 ** 70),
                                 # True is no seed, depth or k (it would reach torch.manual_seed as a bool)
                                 dict(seed=True), dict(num_loops=True), dict(top_k=True)])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_bad_prompts_are_rejected():
    llm = LLM(golden_case("ouro-tiny").path, hal="cpu", dtype="float32")
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 999]])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")


def test_requests_do_not_outlive_a_failed_generate_or_a_closed_stream():
    """An invalid prompt after valid ones withdraws those too; a stream the caller stops reading ends
    its request and frees its blocks."""
    llm = LLM(golden_case("ouro-tiny").path, hal="cpu", dtype="float32")
    free = llm.engine.blocks.num_free_blocks
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 3], [1, 999]])
    assert not llm.engine.has_unfinished_requests() and llm.engine.blocks.num_free_blocks == free
    stream = llm.stream([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    assert not next(stream).finished
    stream.close()
    assert not llm.engine.has_unfinished_requests() and llm.engine.blocks.num_free_blocks == free


def test_streams_and_generate_interleave_each_with_its_own_outputs():
    """Two open streams, read in turns, and a generate while a stream is open: every call gets its
    own request's outputs (one call's engine steps advance the others', whose outputs wait for them)."""
    import itertools

    llm = LLM(golden_case("ouro-tiny").path, hal="cpu", dtype="float32")
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    first, second = llm.generate([[1, 2, 3], [4, 5]], greedy)
    a, b = llm.stream([1, 2, 3], greedy), llm.stream([4, 5], greedy)
    turns = list(itertools.zip_longest(a, b))
    assert [o.token_ids for o in turns[-1]] == [first.token_ids, second.token_ids]
    assert [len(pair[0].token_ids) for pair in turns] == [1, 2, 3, 4, 5] and turns[-1][0].finished
    stream = llm.stream([1, 2, 3], greedy)
    assert next(stream).token_ids == first.token_ids[:1]
    assert llm.generate([4, 5], greedy)[0].token_ids == second.token_ids
    assert [o.token_ids for o in stream][-1] == first.token_ids
    assert not llm.engine.has_unfinished_requests() and not llm._outputs


def test_token_ids_of_numpy_and_torch_and_clear_errors_for_the_rest():
    """A 1-D NumPy array or tensor, or a list of NumPy integers, is one prompt of ids; None, a
    number, bools and an empty SamplingParams list are refused naming the forms."""
    import numpy as np

    llm = LLM(golden_case("ouro-tiny").path, hal="cpu", dtype="float32")
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    want = llm.generate([5, 6, 7], greedy)[0].token_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)]):
        (out,) = llm.generate(prompt, greedy)
        assert out.prompt_token_ids == [5, 6, 7] and out.token_ids == want
    rows = llm.generate(torch.tensor([[5], [6]]), greedy)          # a row of one id is a prompt too
    assert [out.prompt_token_ids for out in rows] == [[5], [6]]
    for bad in (None, 5, [True, False]):
        with pytest.raises(TypeError, match="a prompt is a string, a list of token ids"):
            llm.generate(bad, greedy)
    with pytest.raises(ValueError, match="0 SamplingParams for 2 prompts"):
        llm.generate([[1], [2]], [])
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^63\)"):
        LLM(golden_case("ouro-tiny").path, hal="cpu", seed=2 ** 64)


def test_exit_threshold_reports_loops():
    case = golden_case("ouro-tiny")
    llm = LLM(case.path, hal="cpu", dtype="float32")
    out = llm.generate(case.prompt(0), SamplingParams(max_tokens=8, temperature=0, exit_threshold=0.5,
                                                      ignore_eos=True))[0]
    assert len(out.loops_per_token) == 8 and all(1 <= n <= 4 for n in out.loops_per_token)


def test_vllm_prompt_forms_and_content_parts(tmp_path):
    """vLLM's `{"prompt": ...}` / `{"prompt_token_ids": ...}` prompts, OpenAI content parts in chat,
    use_tqdm, and the checkpoint's generation_config as the default sampling (vLLM's rules)."""
    import json
    import shutil
    from pathlib import Path

    packaged = Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny"
    llm = LLM(packaged, hal="cpu", dtype="float32", num_kv_blocks=128)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    text = "In the beginning"
    ids = llm.tokenizer.encode(text)
    plain = llm.generate(text, greedy)[0]
    by_dict = llm.generate({"prompt": text}, greedy, use_tqdm=False)
    by_ids = llm.generate([{"prompt_token_ids": ids}], greedy)
    assert len(by_dict) == 1 and by_dict[0].token_ids == by_ids[0].token_ids == plain.token_ids
    assert by_dict[0].prompt == text and by_ids[0].prompt_token_ids == ids
    with pytest.raises(TypeError, match="'prompt' \\(text\\) or 'prompt_token_ids'"):
        llm.generate({"text": text}, greedy)
    with pytest.raises(TypeError, match="a prompt is a string, a list of token ids"):
        llm.generate([3.5], greedy)

    turn = {"role": "user", "content": "Hi"}
    assert llm.chat(iter([turn]), greedy)[0].token_ids == llm.chat([turn], greedy)[0].token_ids

    from runtime.text.chat import check_messages
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi,"}, {"type": "text", "text": "there"}]}]
    assert check_messages(parts)[0]["content"] == "Hi,\nthere"          # a line each, as vLLM joins them
    with pytest.raises(ValueError, match="content parts must be text"):
        check_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])

    folder = tmp_path / "ckpt"
    shutil.copytree(packaged, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5, "min_p": 0.1}))
    defaults = LLM(folder, hal="cpu", dtype="float32", num_kv_blocks=64).get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.min_p) == (0.0, 5, 1.0, 0.1)
    assert llm.get_default_sampling_params() == SamplingParams()


def test_vllm_constructor_arguments(tmp_path):
    """What a vLLM user passes to LLM(...): trust_remote_code (ignored: the models are zoo's own),
    dtype="auto" (the checkpoint's), tensor_parallel_size (1 here; more is torchrun's), enforce_eager
    (graphs off), tokenizer as a folder, get_tokenizer(); unknown keywords name the options there are."""
    from pathlib import Path

    from runtime.config import EngineConfig
    from runtime.text.tokenizer import Tokenizer

    packaged = Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny"
    case = golden_case("ouro-tiny")                    # float32 weights, no tokenizer.json
    greedy = SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True)
    for remote in (True, False):
        llm = LLM(case.path, hal="cpu", dtype="auto", trust_remote_code=remote, tensor_parallel_size=1,
                  num_kv_blocks=64)
        assert next(llm.model.parameters()).dtype == torch.float32
        assert llm.generate(case.prompt(0), greedy)[0].token_ids == case.greedy(0)
        assert llm.get_tokenizer() is None
    bf16 = LLM(packaged, hal="cpu", dtype="auto", enforce_eager=True, num_kv_blocks=64)
    assert next(bf16.model.parameters()).dtype == torch.bfloat16       # the config's torch_dtype
    assert bf16.engine.config.graphs is False
    assert isinstance(bf16.get_tokenizer(), Tokenizer) and bf16.get_tokenizer() is bf16.tokenizer
    assert LLM(case.path, hal="cpu", enforce_eager=False, num_kv_blocks=64).engine.config.graphs is None
    eager = LLM(case.path, hal="cpu", enforce_eager=True, engine_config=EngineConfig(num_kv_blocks=64))
    assert eager.engine.config.graphs is False and eager.engine.config.num_kv_blocks == 64
    with pytest.raises(ValueError, match="enforce_eager=True and graphs=True"):
        LLM(case.path, hal="cpu", enforce_eager=True, graphs=True)

    # the packaged weights without their tokenizer files: the tokenizer, given as a folder, serves text
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(packaged / name)
    assert LLM(bare, hal="cpu", num_kv_blocks=64).get_tokenizer() is None
    text, short = "In the beginning", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = bf16.generate(text, short)[0]
    for folder in (str(packaged), packaged):
        llm = LLM(bare, hal="cpu", tokenizer=folder, num_kv_blocks=64)
        out = llm.generate(text, short)[0]
        assert out.prompt_token_ids == expected.prompt_token_ids and out.token_ids == expected.token_ids
        assert out.text == expected.text and len(out.text) > 5
    given = bf16.tokenizer
    assert LLM(case.path, hal="cpu", tokenizer=given, num_kv_blocks=64).get_tokenizer() is given
    with pytest.raises(ValueError, match=f"tokenizer='{bare}' has no tokenizer.json"):
        LLM(case.path, hal="cpu", tokenizer=bare)
    with pytest.raises(ValueError, match="tokenizer='/no/such/folder' is not a folder"):
        LLM(case.path, hal="cpu", tokenizer="/no/such/folder")

    with pytest.raises(ValueError) as err:
        LLM(case.path, hal="cpu", tensor_parallel_size=2)
    assert "torchrun --nproc-per-node 2 -m runtime.generate model=... parallel.tp=2" in str(err.value)
    assert "runtime.parallel.state.init_distributed(hal, 2)" in str(err.value)
    assert "runtime.llm.follow(model, hal, dtype, parallel)" in str(err.value)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(case.path, hal="cpu", tensor_parallel_size=0)
    from runtime.llm_options import check_tensor_parallel_size
    from runtime.parallel.state import ParallelState

    two_ranks = ParallelState(0, 2)                      # what init_distributed gives under torchrun
    check_tensor_parallel_size(1, two_ranks)            # the default, and the size parallel= has
    check_tensor_parallel_size(2, two_ranks)
    with pytest.raises(ValueError, match="tensor_parallel_size=4, but LLM"):
        check_tensor_parallel_size(4, two_ranks)

    with pytest.raises(TypeError) as err:
        LLM(case.path, hal="cpu", max_num_seq=4)
    message = str(err.value)
    assert "unexpected keyword argument 'max_num_seq' (did you mean 'max_num_seqs'?)" in message
    assert "EngineConfig" not in message.split(".")[0]       # not the dataclass's own TypeError
    for option in ("seed", "trust_remote_code", "tensor_parallel_size", "enforce_eager", "tokenizer",
                   "num_kv_blocks", "kv_mode", "graphs"):
        assert option in message
    with pytest.raises(TypeError, match="'swap_space'"):
        LLM(case.path, hal="cpu", swap_space=4)
    with pytest.raises(ValueError, match="not both"):
        LLM(case.path, hal="cpu", engine_config=EngineConfig(), num_kv_blocks=64)


def test_llm_seed_makes_unseeded_sampling_reproducible():
    """LLM(seed=S) seeds the global RNGs, which unseeded requests sample from: the same seed gives
    the same text in a new LLM, another seed other text; a request's own seed ignores it (vLLM's rules)."""
    from pathlib import Path

    packaged = Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny"
    unseeded = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    own_seed = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=7)
    prompts = ["In the beginning", "The meaning of life is"]

    def run(seed, params):
        llm = LLM(packaged, hal="cpu", num_kv_blocks=64, seed=seed)
        return [out.text for out in llm.generate(prompts, params)]

    first = run(3, unseeded)
    torch.rand(100)                                    # draws between the runs do not matter
    assert run(3, unseeded) == first and all(len(text) > 20 for text in first)
    assert run(4, unseeded) != first
    assert run(3, own_seed) == run(4, own_seed) == run(None, own_seed)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^63\)"):
        LLM(packaged, hal="cpu", seed=-1)


def test_logprobs_carry_each_tokens_text():
    """vLLM's `Logprob.decoded_token`: each entry of the sampled and prompt logprobs carries its token's
    own text (special tokens kept) where the LLM has a tokenizer."""
    from pathlib import Path

    llm = LLM(Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny", hal="cpu", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = llm.generate("In the beginning", params)[0]
    entries = [lp for lp in out.logprobs + out.prompt_logprobs if lp is not None]
    assert len(entries) == 4 + len(out.prompt_token_ids) - 1
    for lp in entries:
        for token, entry in lp.items():
            assert entry.decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
    assert "".join(lp[lp.token_id].decoded_token for lp in out.logprobs) == llm.tokenizer.decode(out.token_ids)


def test_max_tokens_none_generates_up_to_the_context():
    """vLLM's max_tokens=None: the sample runs until the context is full (here 40 blocks of 16 hold
    161 tokens of a 4-loop request)."""
    llm = LLM(golden_case("ouro-tiny").path, hal="cpu", dtype="float32", num_kv_blocks=40)
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == llm.engine.max_request_len(4) - 3 == 158
    with pytest.raises(ValueError, match=r"min_tokens=159 is more than the 158 tokens .* \(max_tokens=None\)"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=159))
    (full,) = llm.generate([[1] * 170], SamplingParams(max_tokens=None))       # fits the context, not the cache
    assert full.finish_reason == "error" and "leaves no room to generate" in full.error
