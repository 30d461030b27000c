"""On an NVIDIA GPU: cuBLASLt at a chosen heuristic rank (hal/cuda/blaslt.py) computes F.linear's
product, eagerly and inside a captured graph, and the table's routing leaves every shape it does not
name on F.linear bit for bit."""
import pytest
import torch
import torch.nn.functional as F

from hal.cuda.blaslt import BlasLt, TableLinear

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("m,n,k", [(1, 3072, 10752), (64, 3072, 6144), (64, 11264, 2048), (3, 256, 512)])
def test_every_candidate_computes_the_product(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    ref = F.linear(x.float(), w.float())
    lt = BlasLt()
    for sm_target in (0, 66):
        candidates = lt.plan(m, n, k, torch.bfloat16, sm_target).candidates
        assert len(candidates) >= 1
        for rank in range(len(candidates)):
            y = lt.linear(x, w, rank, sm_target)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (sm_target, rank, err)


def test_table_linear_in_a_graph_and_its_fallback():
    lt = BlasLt()
    m, n, k = 64, 3072, 6144
    rank = len(lt.plan(m, n, k, torch.bfloat16, 88).candidates) - 1
    table = TableLinear(lt, {(m, n, k): (88, rank)}, torch.bfloat16)
    x = torch.randn(2, m // 2, k, device="cuda", dtype=torch.bfloat16)      # leading dims are flattened
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    eager = table(x, w)
    assert eager.shape == (2, m // 2, n)
    assert torch.equal(eager, lt.linear(x.reshape(m, k), w, rank, 88).view(2, m // 2, n))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        table(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = table(x, w)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, table(x, w))
    other = torch.randn(5, k, device="cuda", dtype=torch.bfloat16)         # not in the table: F.linear
    assert torch.equal(table(other, w), F.linear(other, w))
    assert torch.equal(table(x.half(), w.half()), F.linear(x.half(), w.half()))
    flat = torch.randn(m * k + 8, device="cuda", dtype=torch.bfloat16)
    offset = flat[8:].view(m, k)                                            # 16 bytes past an allocation
    assert torch.equal(table(offset, w), F.linear(offset, w))
    beyond = TableLinear(lt, {(m, n, k): 99}, torch.bfloat16)                # a rank the heuristic lacks
    assert torch.equal(beyond(x, w), F.linear(x, w))
