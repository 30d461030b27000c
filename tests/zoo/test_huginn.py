"""Huginn-0125 reproduces the reference's golden logits (zero initial state, float32, 1e-4); its
random initial state, KV planes, tied weights and truncated-backprop loops behave as documented."""
import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import zoo
from helpers import CONFIGS, golden_case
from norm_ops import NormOpsCpu, StreamAdds, huginn_launches
from zoo.base import causal_lm_loss
from zoo.context import DenseContext, ModelOps
from zoo.fp8 import Fp8Linear, quantize_fp8
from zoo.huginn.model import _FIRST_NORM
from zoo.layers import run_layers

TOL = 1e-4


@pytest.fixture(scope="module")
def case_and_model():
    case = golden_case("huginn-tiny")
    return case, zoo.from_pretrained(case.path, dtype="float32")


def test_logits_for_every_recurrence_count(case_and_model):
    case, model = case_and_model
    counts = sorted({int(k.split("steps")[1]) for k in case.tensors if "_steps" in k})
    assert counts == [1, 4, 7]
    for i in range(case.num_prompts):
        ids = torch.tensor([case.prompt(i)])
        for n in counts:
            with torch.no_grad():
                out = model(ids, num_loops=n, init_scale=0.0)
            torch.testing.assert_close(out.logits[0], case.tensors[f"logits_{i}_steps{n}"], atol=TOL, rtol=0)
            assert out.num_loops == n


def test_tied_head_loads_from_either_stored_copy(case_and_model, tmp_path):
    case, model = case_and_model
    stored = load_file(str(case.path / "model.safetensors"))
    # the golden file holds both copies of the tied matrix and the rotary table, as the hub file may
    assert {"lm_head.weight", "transformer.wte.weight", "freqs_cis"} <= set(stored)
    assert model.lm_head.weight is model.transformer.wte.weight
    del stored["lm_head.weight"]
    shutil.copy(case.path / "config.json", tmp_path)
    save_file(stored, str(tmp_path / "model.safetensors"))
    once = zoo.from_pretrained(tmp_path, dtype="float32")
    ids = torch.tensor([case.prompt(0)])
    with torch.no_grad():
        torch.testing.assert_close(once(ids, num_loops=2, init_scale=0.0).logits,
                                   model(ids, num_loops=2, init_scale=0.0).logits, atol=0, rtol=0)


def test_seeded_initial_state_is_reproducible_and_truncated(case_and_model):
    _, model = case_and_model
    e = torch.randn(4, 64, model.config.n_embd)
    draw = lambda seed, scale=None: model.initial_state(e, scale, torch.Generator().manual_seed(seed))  # noqa: E731
    a, b, c = draw(3), draw(3), draw(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    bound = 3 * model.config.init_std * model.config.embed_scale
    assert a.abs().max() <= bound * (1 + 1e-6)
    # a normal truncated at 3 std has std 0.9866 of the untruncated one
    torch.testing.assert_close(a.std(), torch.tensor(0.9866 * bound / 3), rtol=0.03, atol=0)
    torch.testing.assert_close(draw(3, 0.5).std(), a.std() / 2, rtol=0.03, atol=0)
    assert torch.equal(model.initial_state(e, 0.0), torch.zeros_like(e))


def test_init_scale_zero_is_a_zero_state_and_forward_is_seedable(case_and_model):
    case, model = case_and_model
    ids = torch.tensor([case.prompt(1)])
    ctx = DenseContext.for_tokens(ids)
    ctx.init_scale = 0.0
    with torch.no_grad():
        state = model.prelude(ids, ctx)                                    # [1, T, 2 * n_embd]
        assert state.shape == (1, ids.shape[1], 2 * model.config.n_embd)
        s = state[..., :model.config.n_embd]
        assert torch.equal(s, torch.zeros_like(s))
        seeded = [model(ids, num_loops=4, generator=torch.Generator().manual_seed(5)).logits
                  for _ in range(2)]
        zero = model(ids, num_loops=4, init_scale=0.0).logits
    assert torch.equal(seeded[0], seeded[1])
    assert not torch.allclose(seeded[0], zero, atol=1e-3)                # the random state matters


class RecordingContext(DenseContext):
    def __init__(self, positions):
        super().__init__(positions)
        self.slots = []

    def attend(self, q, k, v, plane, layer, scale):
        self.slots.append((plane, layer))
        return super().attend(q, k, v, plane, layer, scale)


def test_kv_planes_prelude_and_coda_once_core_per_loop(case_and_model):
    _, model = case_and_model
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    ctx = RecordingContext(torch.arange(5)[None])
    ctx.init_scale = 0.0
    with torch.no_grad():
        state = model.prelude(ids, ctx)
        for depth in range(3):
            state = model.loop(state, depth, ctx)
        logits = model.coda(state, ctx)
        torch.testing.assert_close(logits, model(ids, num_loops=3, init_scale=0.0).logits, atol=0, rtol=0)
    # prelude 1 layer (plane 0 slot 0), core 2 layers on planes 1..3, coda 1 layer (plane 0 slot 1)
    assert ctx.slots == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1), (0, 1)]
    spec = model.kv_spec
    assert spec == zoo.KVSpec(4, 16, 2, 1) and spec.num_planes(3) == 4


def test_truncated_backprop_loops(case_and_model):
    case, model = case_and_model
    ids = torch.tensor([case.prompt(2)])
    with torch.no_grad():
        full = model(ids, num_loops=3, init_scale=0.0).logits
    split = model(ids, num_loops=(2, 1), labels=ids, init_scale=0.0)
    torch.testing.assert_close(split.logits, full, atol=1e-5, rtol=0)
    assert split.num_loops == 3 and split.logits.requires_grad
    with pytest.raises(ValueError, match="num_loops"):
        model(ids, num_loops=(1, 2, 3))


@pytest.mark.parametrize("key,value", [("injection_type", "add"), ("state_init", "zero"),
                                       ("test_time_noise", 0.1), ("head_dim", 8)])
def test_unsupported_variants_are_refused(key, value):
    config = json.loads((golden_case("huginn-tiny").path / "config.json").read_text())
    config[key] = value
    with pytest.raises(ValueError, match=key):
        zoo.from_config(config, device="meta")


def test_real_shape_parameter_count_on_meta():
    model = zoo.from_config(CONFIGS / "huginn-0125.json", device=torch.device("meta"))
    assert model.num_parameters() == 3_564_976_800
    assert model.default_num_loops == 32 and model.max_seq_len == 4096
    assert model.stop_token_ids() == (65505, 65508)
    assert model.kv_spec == zoo.KVSpec(55, 96, 4, 1)
    assert model.lm_head.weight.dtype == torch.bfloat16


def _launches(model, ids, hal_names, **kwargs):
    """The output of a forward through the ops `hal_names`, and its op calls and stream adds."""
    with StreamAdds(model.config.n_embd) as adds:
        hal = NormOpsCpu(hal_names, adds)
        out = model(ids, ops=ModelOps(hal), init_scale=0.0, **kwargs)
    return out, {**hal.calls, "add": adds.count}


@pytest.mark.parametrize("blocks", [None, (2, 3, 2)], ids=["golden", "2-3-2-blocks"])
def test_norm_add_norm_wiring_keeps_the_logits(case_and_model, blocks):
    """With `norm_add_norm` each sandwich block's boundaries go through it (add, n2, n3; add, n4 and
    the next block's n1 across blocks of a run, the coda's last into ln_f): the logits after every
    loop stay those of plain torch bit for bit, with the launch counts of `huginn_launches`. With
    gradients recorded (training, checkpointing) no op is asked for."""
    case, model = case_and_model
    if blocks is not None:                  # more blocks per run: fusion across blocks of each run
        config = json.loads((case.path / "config.json").read_text())
        config.update(n_layers_in_prelude=blocks[0], n_layers_in_recurrent_block=blocks[1],
                      n_layers_in_coda=blocks[2], n_layers=sum(blocks))
        model = zoo.from_config(config, dtype="float32", seed=3)
        with torch.no_grad():               # norm weights unlike each other, so a swap shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.mul_(torch.rand_like(p) + 0.5)
    ids, loops = torch.tensor([case.prompt(0)]), 3
    kwargs = dict(num_loops=loops, return_step_logits=True)
    with torch.no_grad():
        plain = model(ids, init_scale=0.0, **kwargs).step_logits
        unfused, unfused_calls = _launches(model, ids, ("rms_norm",), **kwargs)
        fused, fused_calls = _launches(model, ids, ("rms_norm", "norm_add_norm"), **kwargs)
    assert torch.equal(unfused.step_logits, plain) and torch.equal(fused.step_logits, plain)
    counts = huginn_launches(model.config, loops, coda_calls=loops)
    assert unfused_calls == counts["unfused"] and fused_calls == counts["fused"], (unfused_calls, fused_calls)
    # some rows through the coda (`rows`, decode): fused, ln_f of every row, then the rows asked for
    ctx = DenseContext.for_tokens(ids, ModelOps(NormOpsCpu()), init_scale=0.0)
    rows = torch.tensor([1, ids.shape[1] - 1])
    with torch.no_grad():
        state = model.loop(model.prelude(ids, ctx), 0, ctx)
        assert torch.equal(model.coda(state, ctx, rows=rows), model.coda(state, rows=rows))
    hal, model = NormOpsCpu(), copy.deepcopy(model).train()
    model.gradient_checkpointing_enable()
    model(ids, num_loops=2, labels=ids, init_scale=0.0, ops=ModelOps(hal)).loss.backward()
    assert not hal.calls


# ----- the adapter split: the state carries c = e @ W_e^T + b, each loop adds s @ W_s^T ------------
class PreludeOutput(DenseContext):
    """Keeps the prelude output e that the initial state is drawn for."""

    def initial_state(self, model, e):
        self.e = e
        return super().initial_state(model, e)


def _biased_model():
    config = json.loads((golden_case("huginn-tiny").path / "config.json").read_text())
    model = zoo.from_config(config | {"bias": True}, dtype="float32", seed=7)
    with torch.no_grad():
        model.transformer.adapter.bias.normal_()
    return model


def _reference_core(model, s, e, depth, ctx):
    """The reference's loop: the whole adapter on `cat[s, e]`, then the core blocks."""
    x = model.transformer.adapter(torch.cat([s, e], dim=-1))
    return run_layers(model.transformer.core_block, x, ctx, 1 + depth, _FIRST_NORM)[0]


@pytest.mark.parametrize("bias", [False, True])
def test_loop_with_the_split_adapter_is_the_whole_adapter_on_cat_s_e(case_and_model, bias):
    case, model = case_and_model
    if bias:
        model = _biased_model()
    adapter, n = model.transformer.adapter, model.config.n_embd
    w_s, w_e = model.adapter_halves()
    # views of the checkpoint's one matrix: columns [0, n) and [n, 2n)
    assert w_s.data_ptr() == adapter.weight.data_ptr()
    assert w_e.data_ptr() == adapter.weight.data_ptr() + n * adapter.weight.element_size()
    ids = torch.tensor([case.prompt(0)])
    ctx = PreludeOutput.for_tokens(ids, generator=torch.Generator().manual_seed(2))   # a random s
    with torch.no_grad():
        state = model.prelude(ids, ctx)
        c = state[..., n:]
        torch.testing.assert_close(c, F.linear(ctx.e, adapter.weight[:, n:], adapter.bias), rtol=1e-6, atol=1e-6)
        for depth in range(3):
            out = model.loop(state, depth, ctx)
            want = _reference_core(model, state[..., :n], ctx.e, depth, ctx)
            torch.testing.assert_close(out[..., :n], want, rtol=1e-5, atol=1e-5)
            assert torch.equal(out[..., n:], c)
            state = out


def _reference_loss(model, ids, no_grad_loops, grad_loops):
    """The reference's truncated backprop: loops without gradient, then loops with it, each on
    `cat[s, e]` with the prelude output e (which keeps its gradient), from a zero state."""
    n = model.config.n_embd
    ctx = DenseContext.for_tokens(ids)
    e = model.transformer.wte(ids) * model.config.embed_scale
    e, _ = run_layers(model.transformer.prelude, e, ctx, 0, _FIRST_NORM)
    s = torch.zeros_like(e)
    for depth in range(no_grad_loops + grad_loops):
        with torch.set_grad_enabled(depth >= no_grad_loops):
            s = _reference_core(model, s, e, depth, ctx)
    logits = model.coda(torch.cat([s, torch.zeros_like(s)], dim=-1), ctx)       # the coda reads s only
    return causal_lm_loss(logits, ids), n


@pytest.mark.parametrize("num_loops", [3, (2, 1)])
def test_split_adapter_gradients_are_the_references(case_and_model, num_loops):
    """Training through the split adapter: the gradients of the reference's math, both halves of the
    adapter's weight and the prelude included, also with loops run without gradient first."""
    case, model = case_and_model
    ids = torch.tensor([case.prompt(2)])
    no_grad_loops, grad_loops = num_loops if isinstance(num_loops, tuple) else (0, num_loops)
    ours, ref = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    ours(ids, num_loops=num_loops, labels=ids, init_scale=0.0).loss.backward()
    loss, n = _reference_loss(ref, ids, no_grad_loops, grad_loops)
    loss.backward()
    grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        want = grads[name].grad                 # float32 sums in another order: 1e-5 of the scale
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5 * want.abs().max().item(), msg=name)
    w_e_grad = ours.transformer.adapter.weight.grad[:, n:]
    assert w_e_grad.abs().max() > 0 and ours.transformer.prelude[0].mlp.fc.weight.grad.abs().max() > 0


def test_fp8_adapter_splits_its_matrix_by_columns(case_and_model):
    """An FP8 adapter: each half is a column view of the FP8 matrix with its row scales, and a loop
    equals the FP8 linear on `cat[s, e]` (both dequantize the same FP8 values)."""
    case, model = case_and_model
    model = copy.deepcopy(model)
    quantize_fp8(model)
    adapter, n = model.transformer.adapter, model.config.n_embd
    assert isinstance(adapter, Fp8Linear)
    w_s, w_e = model.adapter_halves()
    assert w_s.weight.data_ptr() == adapter.weight.data_ptr() and w_e.weight.data_ptr() == adapter.weight.data_ptr() + n
    assert w_s.scale is adapter.weight_scale and w_e.scale is adapter.weight_scale
    ids = torch.tensor([case.prompt(1)])
    ctx = PreludeOutput.for_tokens(ids, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        state = model.prelude(ids, ctx)
        torch.testing.assert_close(state[..., n:], adapter(torch.cat([torch.zeros_like(ctx.e), ctx.e], dim=-1)),
                                   rtol=1e-5, atol=1e-5)
        out = model.loop(state, 0, ctx)
        want = _reference_core(model, state[..., :n], ctx.e, 0, ctx)
    torch.testing.assert_close(out[..., :n], want, rtol=1e-5, atol=1e-5)


def test_an_adapter_the_split_does_not_know_is_refused(case_and_model):
    model = copy.deepcopy(case_and_model[1])
    model.transformer.adapter = torch.nn.Sequential(model.transformer.adapter)
    with pytest.raises(TypeError, match="adapter"):
        model.adapter_halves()
