"""Ouro reproduces the reference implementation's golden tensors (float32, 1e-4)."""
import copy
import json

import pytest
import torch

import zoo
from helpers import CONFIGS, golden_case, golden_names
from norm_ops import NormOpsCpu
from zoo.context import ModelOps
from zoo.fuse import fuse_projections
from zoo.ouro import exit_distribution, first_exit_step

TOL = 1e-4


@pytest.fixture(scope="module", params=golden_names("ouro"))
def case_and_model(request):
    case = golden_case(request.param)
    return case, zoo.from_pretrained(case.path, dtype="float32")


def test_logits_step_logits_pdf_and_loss(case_and_model):
    case, model = case_and_model
    for i in range(case.num_prompts):
        ids = torch.tensor([case.prompt(i)])
        with torch.no_grad():
            out = model(ids, labels=ids, return_step_logits=True)
        t = case.tensors
        torch.testing.assert_close(out.logits[0], t[f"logits_{i}"], atol=TOL, rtol=0)
        torch.testing.assert_close(out.step_logits[:, 0], t[f"step_logits_{i}"], atol=TOL, rtol=0)
        torch.testing.assert_close(out.loss.reshape(1), t[f"loss_{i}"], atol=TOL, rtol=0)
        hazards = t[f"exit_lambda_{i}"].T                                   # [T, S]
        torch.testing.assert_close(out.exit_pdf[0], exit_distribution(hazards), atol=TOL, rtol=0)
        assert out.exit_pdf.shape == (1, len(case.prompt(i)), model.config.total_ut_steps)


def test_threshold_logits(case_and_model):
    case, model = case_and_model
    for q_text, margin in case.meta["threshold_margin"].items():
        assert margin > 1e-5, "golden margin too small for a float32 comparison"
        for i in range(case.num_prompts):
            ids = torch.tensor([case.prompt(i)])
            with torch.no_grad():
                out = model(ids, exit_threshold=float(q_text))
            torch.testing.assert_close(out.logits[0], case.tensors[f"threshold_logits_{i}_q{q_text}"],
                                       atol=TOL, rtol=0)


def test_default_threshold_is_full_depth(case_and_model):
    case, model = case_and_model
    ids = torch.tensor([case.prompt(0)])
    with torch.no_grad():
        full = model(ids, return_step_logits=True)
    torch.testing.assert_close(full.logits, full.step_logits[-1], atol=0, rtol=0)


def test_exit_distribution_and_selection():
    hazards = torch.tensor([[0.5, 0.5, 0.5, 0.9]])
    pdf = exit_distribution(hazards)
    torch.testing.assert_close(pdf, torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    assert first_exit_step(pdf, 0.5).tolist() == [0]
    assert first_exit_step(pdf, 0.7).tolist() == [1]
    assert first_exit_step(pdf, 0.99).tolist() == [3]      # never reached: the last loop


@pytest.mark.parametrize("name,count", [("ouro-1.4b", 1_434_652_673), ("ouro-2.6b", 2_667_974_657),
                                        ("ouro-1.4b-thinking", 1_434_652_673)])
def test_real_shape_parameter_count_on_meta(name, count):
    model = zoo.from_config(CONFIGS / f"{name}.json", device=torch.device("meta"))
    assert model.num_parameters() == count
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_loops_are_configurable(case_and_model):
    case, model = case_and_model
    ids = torch.tensor([case.prompt(0)])
    with torch.no_grad():
        two = model(ids, num_loops=2, return_step_logits=True)
        full = model(ids, return_step_logits=True)
    assert two.step_logits.shape[0] == 2
    torch.testing.assert_close(two.step_logits, full.step_logits[:2])


def test_trains_loss_decreases():
    model = zoo.from_config(golden_case("ouro-tiny").path / "config.json", dtype="float32", seed=0).train()
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_gradient_checkpointing_gives_same_gradients():
    base = zoo.from_config(golden_case("ouro-tiny").path / "config.json", dtype="float32", seed=0).train()
    ids = torch.randint(0, base.config.vocab_size, (2, 9))
    base(ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in base.named_parameters()}
    base.zero_grad()
    base.gradient_checkpointing_enable()
    base(ids, labels=ids).loss.backward()
    for n, p in base.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fused_projections", [False, True], ids=["linears", "fused"])
def test_norm_add_norm_wiring_keeps_the_logits(case_and_model, fused_projections):
    """With `norm_add_norm` every sandwich boundary goes through it (inside each layer, into the next
    layer's input norm, into the loop's final norm): per loop 2 calls per layer and one plain norm
    (the first layer's input) where there were 4 per layer and the final norm. The logits stay
    those of plain torch bit for bit; with gradients recorded no op is asked for."""
    case, model = case_and_model
    model = fuse_projections(copy.deepcopy(model)) if fused_projections else model
    layers, loops = model.config.num_hidden_layers, model.config.total_ut_steps
    ids = torch.tensor([case.prompt(0)])
    hal = NormOpsCpu()
    with torch.no_grad():
        plain = model(ids, return_step_logits=True).step_logits
        fused = model(ids, return_step_logits=True, ops=ModelOps(hal)).step_logits
    assert torch.equal(fused, plain)
    assert hal.calls == {"norm_add_norm": 2 * layers * loops, "rms_norm": loops}
    without = NormOpsCpu(("rms_norm",))
    with torch.no_grad():
        assert torch.equal(model(ids, return_step_logits=True, ops=ModelOps(without)).step_logits, plain)
    assert without.calls == {"rms_norm": (4 * layers + 1) * loops}
    model(ids, ops=ModelOps(hal))                                           # grads on: plain torch
    assert sum(hal.calls.values()) == (2 * layers + 1) * loops


def test_rope_parameters_of_transformers_5_are_read():
    """transformers 5 writes rope_theta (and any scaling) inside rope_parameters."""
    raw = json.loads((golden_case("ouro-tiny").path / "config.json").read_text())
    v5 = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    assert zoo.build(v5)[1].rope_theta == 12345.0
    with pytest.raises(ValueError, match="rope_parameters=.*not supported by zoo.ouro"):
        zoo.build(v5 | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    assert zoo.build(raw | {"rope_scaling": {"rope_type": "default"}})[1].rope_theta == raw["rope_theta"]
