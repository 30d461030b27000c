"""Huginn and Nanbeige train as plain modules: the loss falls, and gradient checkpointing gives the
same gradients."""
import pytest
import torch

import zoo
from helpers import golden_case

# Huginn's forward takes a generator for its random initial state; the same seed gives the same state
KWARGS = {
    "huginn-tiny": lambda: dict(num_loops=2, generator=torch.Generator().manual_seed(11)),
    "nanbeige-tiny": lambda: dict(),
}


def tiny(name: str) -> zoo.LoopedCausalLM:
    return zoo.from_config(golden_case(name).path / "config.json", dtype="float32", seed=0).train()


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_trains_loss_decreases(name):
    model = tiny(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids, **KWARGS[name]()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_gradient_checkpointing_gives_same_gradients(name):
    model = tiny(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    model(ids, labels=ids, **KWARGS[name]()).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "embed" not in n and "wte" not in n), \
        "every weight should get a gradient"
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(ids, labels=ids, **KWARGS[name]()).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5)
