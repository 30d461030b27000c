"""runtime/roofline.py: what a step must read, per family (meta-device models at the real shapes)."""
from __future__ import annotations

import torch

import zoo
from runtime.roofline import decode_floor, model_costs


def _meta(name: str):
    with torch.device("meta"):
        return zoo.from_config(f"zoo/configs/{name}.json")


def test_huginn_reads_its_adapter_prelude_half_once_per_step(monkeypatch):
    """Huginn's adapter multiplies the prelude output once per step (`c = e @ W_e^T + b`), the state
    once per loop: the loop bytes hold W_s and the core block, the once-per-step bytes W_e (and b)."""
    model = _meta("huginn-0125")
    n, bias = model.config.n_embd, model.transformer.adapter.bias
    hoisted = n * n + (bias.numel() if bias is not None else 0)
    costs = model_costs(model, 32)
    core = sum(p.numel() for p in model.transformer.core_block.parameters())
    assert costs.loop_params == core + n * n and costs.loop_bytes == 2 * (core + n * n)     # bf16
    monkeypatch.setattr(model, "step_weights_of_loop_modules", list)
    whole = model_costs(model, 32)                                  # the adapter counted in every loop
    assert (whole.loop_params - costs.loop_params, costs.once_params - whole.once_params) == (hoisted, hoisted)
    saved = decode_floor(whole, 32, 1, 256).bytes - decode_floor(costs, 32, 1, 256).bytes
    assert saved == 31 * 2 * hoisted                               # 32 reads of W_e become one


def test_families_without_hoisted_weights_count_their_loop_modules_whole():
    model = _meta("ouro-1.4b")
    costs = model_costs(model, 4)
    assert costs.loop_params == sum(p.numel() for m in model.loop_modules() for p in m.parameters())
