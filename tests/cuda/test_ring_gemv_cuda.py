"""On an sm_90 GPU: the TMA-ring one-row projection (hal/cuda/ring_gemv.py) computes the product at the
model shapes and ragged ones (N and K past the boxes), writes every output (a NaN-filled output is
overwritten), gives the same bits run after run and inside a captured graph chained by PDL, and its
routing leaves every other operand to the library."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.cuda

ring = pytest.importorskip("hal.cuda.ring_gemv")

if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the TMA ring is built for sm_90", allow_module_level=True)

SHAPES = [(8192, 3072), (3072, 6144), (21504, 3072), (3072, 10752),      # Nanbeige4.2-3B
          (15840, 5280), (5280, 17920),                                  # Huginn-0125
          (6144, 2048), (1000, 3000), (24, 520)]                          # Ouro-1.4B q|k|v; ragged


def _operands(n, k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
    w = (torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("config", [ring.DEFAULT, ring.RingConfig(1, 16, 256, 2, 6, 4)])
def test_the_ring_computes_the_product(n, k, config):
    x, w = _operands(n, k)
    assert ring.takes(x, w)
    out = torch.full((1, n), float("nan"), device="cuda", dtype=x.dtype)
    y = ring.ring_linear(x, w, config, out=out)
    ref = F.linear(x.float(), w.float())
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 4e-3, err
    assert not torch.isnan(y).any()
    lib = F.linear(x, w).float()       # cuBLAS's own rounding error is of the same size
    assert err < 2 * ((lib - ref).norm() / ref.norm()).item() + 2e-3
    again = ring.ring_linear(x, w, config)
    assert torch.equal(again, y)


def test_the_ring_in_a_graph_chained_by_pdl():
    # three products, each reading the one before: a launch that started early (PDL) and read its
    # input before the launch before had written it would give other values than the eager chain
    x, w1 = _operands(3072, 3072, seed=1)
    w2, w3 = _operands(3072, 3072, seed=2)[1], _operands(8192, 3072, seed=3)[1]

    def chain(x):
        return ring.ring_linear(ring.ring_linear(ring.ring_linear(x, w1), w2), w3)

    eager = chain(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(x)                             # compiles and caches the descriptors outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


def test_routing_takes_one_row_table_shapes_and_leaves_the_rest(monkeypatch):
    calls = []

    def library(x, w):
        calls.append(tuple(x.shape))
        return F.linear(x, w)

    x, w = _operands(3072, 6144)
    routed = ring.RingOr(library, {(3072, 6144): ring.DEFAULT}, every=False, pdl=True)
    y = routed(x.view(1, 1, -1), w)                          # leading dims of one row are fine
    assert y.shape == (1, 1, 3072) and calls == []
    assert torch.equal(y.view(1, -1), ring.ring_linear(x, w))
    routed(torch.cat([x, x]), w)                             # two rows: the library
    routed(x, torch.randn(1024, 6144, device="cuda", dtype=torch.bfloat16))   # a shape not in the table
    routed(x.float(), w.float())                             # not 16-bit
    assert calls == [(2, 6144), (1, 6144), (1, 6144)]
    monkeypatch.setenv(ring.ENV, "0")
    assert ring.ring_or(library, "sm_90", True) is library
    monkeypatch.setenv(ring.ENV, "1")
    assert isinstance(ring.ring_or(library, "sm_90", True), ring.RingOr)
    assert ring.ring_or(library, "sm_80", True) is library


@pytest.mark.parametrize("bits", [True, False], ids=["bits", "cvt"])
@pytest.mark.parametrize("n,k", [(6144, 2048), (2048, 5632), (1000, 3008), (24, 528)])
@pytest.mark.parametrize("config", [ring.RingConfig(1, 16, 256, 4, 4, 8), ring.RingConfig(2, 16, 256, 2, 4, 4)])
def test_the_fp8_ring_computes_the_scaled_product(n, k, config, bits):
    """E4M3 weights with a float32 scale per row (W8A16): `x @ (w * scale[:, None])^T`, subnormal
    weights included (widened by moving bits, the values are 2^-120 of theirs until the scale)."""
    x, w = _operands(n, k)
    scale = (w.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    q = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
    q[:, :64] = ((torch.arange(64, device="cuda") % 8).float() * 2 ** -9).to(torch.float8_e4m3fn)  # subnormals
    assert ring.takes(x, q, scale) and not ring.takes(x, q) and not ring.takes(x, w, scale)
    out = torch.full((1, n), float("nan"), device="cuda", dtype=x.dtype)
    y = ring.ring_linear(x, q, config, out=out, scale=scale, bits=bits)
    ref = F.linear(x.float(), q.float() * scale[:, None])
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 4e-3, err
    assert torch.equal(ring.ring_linear(x, q, config, scale=scale, bits=bits), y)
