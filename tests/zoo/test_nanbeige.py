"""Nanbeige4.2 reproduces the reference's golden logits and loss (float32, 1e-4) and refuses the
optional features the released checkpoint leaves off."""
import copy
import json

import pytest
import torch

import zoo
from helpers import CONFIGS, golden_case
from norm_ops import NormOpsCpu, StreamAdds, nanbeige_launches
from zoo.context import ModelOps
from zoo.fuse import fuse_projections

TOL = 1e-4


@pytest.fixture(scope="module")
def case_and_model():
    case = golden_case("nanbeige-tiny")
    return case, zoo.from_pretrained(case.path, dtype="float32")


def test_logits_and_loss(case_and_model):
    case, model = case_and_model
    for i in range(case.num_prompts):
        ids = torch.tensor([case.prompt(i)])
        with torch.no_grad():
            out = model(ids, labels=ids)
        torch.testing.assert_close(out.logits[0], case.tensors[f"logits_{i}"], atol=TOL, rtol=0)
        torch.testing.assert_close(out.loss.reshape(1), case.tensors[f"loss_{i}"], atol=TOL, rtol=0)
        assert out.num_loops == 2


def test_stages_compose_and_loops_are_configurable(case_and_model):
    case, model = case_and_model
    ids = torch.tensor([case.prompt(1)])
    with torch.no_grad():
        state = model.prelude(ids)
        states = []
        for depth in range(3):
            state = model.loop(state, depth)
            states.append(state)
        for n in (1, 3):
            full = model(ids, num_loops=n).logits
            torch.testing.assert_close(model.coda(states[n - 1]), full, atol=0, rtol=0)
    assert model.exit_hazard(state) is None
    assert model.kv_spec == zoo.KVSpec(2, 32, 2, 0)


@pytest.mark.parametrize("key,value", [
    ("enable_mhc", True), ("enable_hyper_connection", True), ("qk_layernorm", True),
    ("loop_loss_weights", [0.5]), ("skip_loop_final_norm", True), ("attention_bias", True),
    ("mlp_bias", True), ("num_residual_streams", 4), ("rope_scaling", {"type": "linear", "factor": 2.0})])
def test_unsupported_features_are_refused_by_name(key, value):
    config = json.loads((golden_case("nanbeige-tiny").path / "config.json").read_text())
    config[key] = value
    with pytest.raises(ValueError, match=key) as err:
        zoo.from_config(config, device="meta")
    assert "zoo.nanbeige does not implement" in str(err.value)


def test_ngram_embeddings_are_refused():
    config = json.loads((golden_case("nanbeige-tiny").path / "config.json").read_text())
    config.update(emb_neighbor_num=2, emb_split_num=4, ngram_vocab_size_ratio=8)
    with pytest.raises(ValueError, match="n-gram embeddings"):
        zoo.from_config(config, device="meta")


def test_real_shape_parameter_count_on_meta():
    model = zoo.from_config(CONFIGS / "nanbeige4.2-3b.json", device=torch.device("meta"))
    assert model.num_parameters() == 4_169_800_704
    assert model.default_num_loops == 2 and model.stop_token_ids() == (166101,)
    assert model.kv_spec == zoo.KVSpec(8, 128, 22, 0)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (6144, 3072)


class NormAndLinearOpsCpu(NormOpsCpu):
    """NormOpsCpu with the `linear` decode projection op too (its epilogue adds the residual)."""

    def op(self, name):
        return self.linear if name == "linear" else super().op(name)

    def linear(self, x, weight, residual=None):
        with self._op("linear"):
            y = torch.nn.functional.linear(x, weight)
            return y if residual is None else residual + y


@pytest.mark.parametrize("fused_projections", [False, True], ids=["linears", "fused"])
def test_norm_add_norm_wiring_keeps_the_logits(case_and_model, fused_projections):
    """With `norm_add_norm` each residual add runs with the norm after it (ln_post inside a layer,
    the next layer's ln_in across layers, the loop's final norm after the last): per loop and layer
    2 norm_add_norm calls where there were 2 adds and 2 norms, plus the first layer's ln_in. The
    logits after every loop stay those of plain torch bit for bit. Where the Hal also has `linear`
    (its epilogue adds the residual) the adds stay in the projections; with gradients recorded
    (training, checkpointing) no op is asked for."""
    case, model = case_and_model
    model = fuse_projections(copy.deepcopy(model)) if fused_projections else model
    loops = model.config.num_loops
    ids = torch.tensor([case.prompt(0)])

    def run(hal):
        with torch.no_grad(), StreamAdds(model.config.hidden_size) as adds:
            hal.adds = adds
            logits = model(ids, return_step_logits=True, ops=ModelOps(hal)).step_logits
        return logits, {**hal.calls, "add": adds.count}

    with torch.no_grad():
        plain = model(ids, return_step_logits=True).step_logits
    unfused, unfused_calls = run(NormOpsCpu(("rms_norm",)))
    fused, fused_calls = run(NormOpsCpu())
    assert torch.equal(unfused, plain) and torch.equal(fused, plain)
    counts = nanbeige_launches(model.config, loops)
    assert unfused_calls == counts["unfused"] and fused_calls == counts["fused"], (unfused_calls, fused_calls)
    with_linear, linear_calls = run(NormAndLinearOpsCpu())
    assert torch.equal(with_linear, plain) and "norm_add_norm" not in linear_calls, linear_calls
    hal, model = NormOpsCpu(), copy.deepcopy(model).train()
    model.gradient_checkpointing_enable()
    model(ids, labels=ids, ops=ModelOps(hal)).loss.backward()
    assert not hal.calls
