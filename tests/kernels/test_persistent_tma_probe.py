"""tools/persistent_tma_probe.py's host side: how its phase table stacks the weights by K and what
each phase reads and writes. Its Gluon kernel (TMA, mbarriers, sm_90) runs only on the GPU (Gluon has
no interpreter); the H200 timings are docs/performance.md's lever 97."""
from __future__ import annotations

import math

import pytest
import torch

probe = pytest.importorskip("persistent_tma_probe", exc_type=ImportError)   # triton's Gluon


def test_vectors_start_on_16_elements():
    vec = probe.Vectors()
    offsets = [vec.add(torch.ones(512)), vec.add(768), vec.add(5), vec.add(16)]
    assert offsets == [0, 512, 1280, 1296]
    assert vec.size == 1312
    assert torch.cat(vec.parts)[:512].eq(1).all() and torch.cat(vec.parts)[512:].eq(0).all()


def test_plan_stacks_weights_by_k_and_tables_every_phase():
    vec = probe.Vectors()
    x, y, z, norm = vec.add(torch.ones(512)), vec.add(768), vec.add(256), vec.add(512)
    a, b, c = torch.randn(768, 512), torch.randn(256, 768), torch.randn(512, 512)
    phases = [(a, x, y, probe.PLAIN, 0, 0, 0), (b, y, z, probe.ADD_NORM, x, norm, x),
              (c, z, x, probe.SWIGLU, 0, 0, 0)]
    plan = probe.Plan(phases, vec, num_programs=4, bn=8, bk=256, boxes=2, device="cpu")
    # K = 512 -> descriptor 0 ([a; c]), K = 768 -> descriptor 1; stages of 2 x 256 along K
    assert [tuple(s.shape) for s in plan.stacks] == [(1280, 512), (256, 768)]
    assert torch.equal(plan.stacks[0][768:], c)
    table = plan.table.view(-1, probe.FIELDS).tolist()
    #                desc row  N    stages in out chunks K    kind             residual norm residual out
    assert table == [[0, 0, 768, 1, x, y, 96, 512, probe.PLAIN, 0, 0, 0],
                     [1, 0, 256, 2, y, z, 32, 768, probe.ADD_NORM, x, norm, x],
                     [0, 768, 512, 1, z, x, 64, 512, probe.SWIGLU, 0, 0, 0]]
    assert plan.x_tiles == 4                     # 768 = two stages of 512: four 256-wide tiles staged
    assert plan.act.numel() == vec.size + 2 * 512   # the staging reads whole stages past a vector's end
    assert [d.block_shape for d in plan.descs] == [[8, 256]] * 3


def test_plan_refuses_k_off_the_tile():
    vec = probe.Vectors()
    with pytest.raises(ValueError, match="multiple of BK"):
        probe.Plan([(torch.randn(64, 320), vec.add(320), vec.add(64), probe.PLAIN, 0, 0, 0)], vec, 4, 8, 256, 1,
                   device="cpu")


def test_chain_reference_reads_the_first_k_or_swiglu_of_both_halves():
    """The chain's float32 reference (lever 102's realistic variant: down reads SwiGLU of all of
    gate|up, as `_stage_input` computes it, rounded to bf16 where the kernel rounds)."""
    torch.manual_seed(0)
    x0 = torch.randn(1, 8).bfloat16()
    gate_up, down = torch.randn(12, 8).bfloat16(), torch.randn(8, 6).bfloat16()
    y = (gate_up.float() @ x0.reshape(-1).float()).bfloat16()
    first, plain = probe._chain_reference([gate_up, down], [probe.PLAIN, probe.PLAIN], x0)
    assert torch.equal(first, y) and torch.equal(plain, (down.float() @ y[:6].float()).bfloat16())
    g, u = y[:6].float(), y[6:].float()
    act = ((g / (1 + torch.exp(-g))).bfloat16().float() * u).bfloat16()
    swiglu = probe._chain_reference([gate_up, down], [probe.PLAIN, probe.SWIGLU], x0)[-1]
    assert torch.equal(swiglu, (down.float() @ act.float()).bfloat16())
    assert not torch.equal(plain, swiglu)


def test_rel_is_absolute_where_the_reference_vanished():
    """The SwiGLU chain's products reach zero after a few layers of random weights: a right answer
    reads 0 there, a product that read its poisoned input too early reads NaN."""
    zero = torch.zeros(4)
    assert probe._rel(zero, zero) == 0.0
    assert probe._rel(torch.tensor([0.0, 1e-3, 0, 0]), zero) == pytest.approx(1e-3)
    assert math.isnan(probe._rel(torch.tensor([float("nan"), 0, 0, 0]), zero))
    assert probe._rel(torch.tensor([1.0, 0, 0, 0]), torch.tensor([2.0, 0, 0, 0])) == 0.5
    assert math.isnan(probe._worst([0.01, float("nan"), 0.02])) and probe._worst([0.01, 0.03]) == 0.03


def test_sentinel_launcher_refuses_an_input_it_would_not_poison():
    """WAIT=2 polls each phase's input for NaN: `outputs` must cover all of it (gate|up whole for
    SwiGLU), and ADD_NORM's unpolled residual must not be written inside the launch."""
    vec = probe.Vectors()
    x, y, z, w = vec.add(torch.ones(256)), vec.add(512), vec.add(256), vec.add(256)
    cfg = (1, 8, 256, 1, 2, 4)
    swiglu = [(torch.randn(512, 256), x, y, probe.PLAIN, 0, 0, 0),
              (torch.randn(256, 256), y, z, probe.SWIGLU, 0, 0, 0)]
    plan = probe.Plan(swiglu, vec, 4, 8, 256, 1, device="cpu")
    probe.launcher(plan, cfg, [(0, 2)], "sentinel", outputs=[(y, 512), (z, 256)])
    with pytest.raises(ValueError, match="does not poison"):      # only gate's half
        probe.launcher(plan, cfg, [(0, 2)], "sentinel", outputs=[(y, 256), (z, 256)])
    probe.launcher(plan, cfg, [(0, 1), (1, 2)], "sentinel", outputs=[(z, 256)])   # y: the launch before
    h = vec.add(256)
    norm = [(torch.randn(256, 256), x, z, probe.PLAIN, 0, 0, 0),
            (torch.randn(256, 256), z, w, probe.ADD_NORM, y, x, h)]
    plan = probe.Plan(norm, vec, 4, 8, 256, 1, device="cpu")
    probe.launcher(plan, cfg, [(0, 2)], "sentinel", outputs=[(z, 256), (w, 256), (h, 256)])
    # the residual out is the next phase's residual: read unpolled while program 0 writes it
    chained = norm + [(torch.randn(256, 256), w, y, probe.ADD_NORM, h, x, z)]
    plan = probe.Plan(chained, vec, 4, 8, 256, 1, device="cpu")
    with pytest.raises(ValueError, match="residual or norm weight"):
        probe.launcher(plan, cfg, [(0, 3)], "sentinel", outputs=[(z, 256), (w, 256), (h, 256), (y, 256)])
