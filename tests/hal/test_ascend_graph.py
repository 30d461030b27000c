"""The Ascend graph contract: a captured step bakes host lengths; each replay needs
`graph.update(backend.update_meta(meta, batch))` (the host params of the calls captured with that
meta), and the replay uses exactly what the update gave. Runs on the CPU simulation; the
`ascend`-marked cases run the same on a 910B (`pytest -m ascend`)."""
import pytest
import torch

import hal
from hal.ascend.sim.npu import GraphReplayError
from hal.attention import MetaCapacity, PagedBatch

TABLES = [[[0], [1, 2, 8], [3]], [[4], [5, 6, 9], [7]]]      # [plane][seq][block]
CAPACITY = MetaCapacity(max_num_seqs=3, max_num_tokens=3, max_blocks_per_seq=2, num_planes=2, max_seq_len=256)


def decode_batch(seq_lens, tables=TABLES):
    tables = [[t[:-(-s // 128)] for t, s in zip(plane, seq_lens)] for plane in tables]
    return PagedBatch([1] * len(seq_lens), seq_lens, tables, 128)


def ascend_hal(where: str):
    """"sim": the strict simulation; "sim-any": shape limits lifted; "npu": the real Hal."""
    if where == "npu":
        return hal.get("ascend")
    return hal.get("ascend-sim", sim_any_shape=where == "sim-any")


class Step:
    """One decode step over two planes with static inputs, as a graph runner would capture it."""

    def __init__(self, backend_name: str, dtype=torch.float32, where: str = "sim-any"):
        # float32 runs the fused path with the NPU's shape limits lifted (head dim 32); bf16 keeps them
        self.hal = ascend_hal(where)
        head_dim, device = (32 if dtype == torch.float32 else 128), self.hal.device()
        self.backend = self.hal.attention(4, 2, head_dim, dtype, backend=backend_name)
        self.cache = torch.randn(self.backend.kv_cache_shape(10), dtype=dtype, device=device)
        self.q, self.k, self.v = (torch.randn(3, n, head_dim, dtype=dtype, device=device) for n in (4, 2, 2))
        self.meta = self.backend.build_meta(decode_batch([5, 140, 30]), CAPACITY)

    def run(self, meta=None, cache=None, planes=2):
        meta, cache = meta or self.meta, self.cache if cache is None else cache
        outs = []
        for plane in range(planes):
            self.backend.write_kv(self.k, self.v, cache, meta, plane)
            outs.append(self.backend.forward(self.q, cache, meta, plane, 0.17))
        return torch.stack(outs)

    def eager(self, seq_lens):
        """The same step run eagerly on a copy of the cache for a freshly built batch."""
        return self.run(self.backend.build_meta(decode_batch(seq_lens)), self.cache.clone())

    def new_inputs(self):
        for t in (self.q, self.k, self.v):
            t.copy_(torch.randn_like(t))


@pytest.mark.parametrize("where, backend_name, dtype", [
    ("sim-any", "fia", torch.float32), ("sim", "fia_pa", torch.bfloat16),
    pytest.param("npu", "fia", torch.bfloat16, marks=pytest.mark.ascend),
    pytest.param("npu", "fia_pa", torch.bfloat16, marks=pytest.mark.ascend),
])
def test_replay_with_update_equals_eager(where, backend_name, dtype):
    step = Step(backend_name, dtype, where)
    step.run()                                                   # warm-up outside capture, as runners do
    graph = step.hal.graph()
    out = graph.capture(step.run)
    site = "paged_decode_attention" if backend_name == "fia_pa" else "fused_infer_attention"
    assert [(c.site, c.plane) for c in graph.calls] == [(site, 0), (site, 1)]
    for seq_lens in ([6, 141, 31], [7, 200, 32], [8, 256, 128]):
        step.new_inputs()
        graph.update(step.backend.update_meta(step.meta, decode_batch(seq_lens)))
        graph.replay()
        step.hal.synchronize()
        torch.testing.assert_close(out, step.eager(seq_lens), atol=0, rtol=0)


def test_replay_uses_the_updated_lengths_not_the_python_ones():
    """A stale update gives the stale lengths' result, as on the NPU, though meta is current."""
    step = Step("fia")
    graph = step.hal.graph()
    out = graph.capture(step.run)
    stale = step.backend.update_meta(step.meta, decode_batch([5, 140, 30]))    # the captured lengths
    fresh = step.backend.update_meta(step.meta, decode_batch([9, 250, 60]))
    assert [p["actual_seq_lengths_kv"] for p in fresh] == [[9, 250, 60]] * 2
    graph.update(stale)
    graph.replay()
    assert not torch.allclose(out, step.eager([9, 250, 60]))
    graph.update(fresh)
    graph.replay()
    torch.testing.assert_close(out, step.eager([9, 250, 60]), atol=0, rtol=0)


def test_forgotten_or_malformed_update_is_caught():
    step = Step("fia")
    graph = step.hal.graph()
    graph.capture(step.run)
    params = step.backend.update_meta(step.meta, decode_batch([6, 141, 31]))
    with pytest.raises(GraphReplayError, match="replay without update"):
        graph.replay()
    with pytest.raises(ValueError, match="got 1 host-param dicts; the graph captured 2"):
        graph.update(params[:1])
    with pytest.raises(ValueError, match="expected"):
        graph.update([{"actual_seq_qlen": [1, 2, 3], "actual_seq_lengths_kv": [6, 141, 31]}, params[1]])
    with pytest.raises(ValueError, match="batch sizes are fixed"):
        graph.update([{**p, "actual_seq_lengths_kv": [6, 141]} for p in params])
    graph.update(params)
    graph.replay()
    with pytest.raises(GraphReplayError, match="replay without update"):   # every replay needs its own
        graph.replay()


def test_update_meta_refuses_other_shapes():
    step = Step("fia")
    with pytest.raises(ValueError, match="captured shape"):
        step.backend.update_meta(step.meta, PagedBatch([2, 1, 1], [6, 141, 31], decode_batch([6, 141, 31])
                                                       .block_tables, 128))
    with pytest.raises(ValueError, match="room for 2"):
        step.backend.update_meta(step.meta, decode_batch([6, 300, 31]))     # 3 blocks, captured with 2
    with pytest.raises(ValueError, match="exceeds the meta capacity: sequences 4 > capacity 3"):
        step.backend.build_meta(decode_batch([1, 2, 3, 4], [[[0], [1], [2], [3]]]), CAPACITY)


def test_repeated_kv_slots_are_refused_in_graph_metas():
    """npu_scatter_pa_kv_cache needs unique slots: two padding rows in one scratch slot are caught on
    the host when the graph meta is filled, not left to undefined KV on the NPU."""
    step = Step("fia")
    shared = [[[0], [1, 2], [0]], [[4], [5, 6], [4]]]                # sequences 0 and 2 share block 0 / 4
    with pytest.raises(ValueError, match=r"plane 0: KV slots \[0\] .* unique slots"):
        step.backend.update_meta(step.meta, decode_batch([1, 140, 1], shared))
    step.backend.update_meta(step.meta, decode_batch([1, 140, 2], shared))   # distinct offsets: fine


def test_each_meta_returns_the_calls_captured_with_it():
    """Graphs of two batch sizes live at once; each meta's update gives its own graph's params."""
    step = Step("fia")
    graph = step.hal.graph()
    out = graph.capture(step.run)
    small = Step("fia")
    small.hal, small.backend = step.hal, step.backend                 # one Hal and backend, two metas
    small.q, small.k, small.v = step.q[:2].clone(), step.k[:2].clone(), step.v[:2].clone()
    two = [plane[:2] for plane in TABLES]
    small.meta = step.backend.build_meta(decode_batch([5, 140], two), CAPACITY._replace(num_planes=2))
    small_graph = step.hal.graph()
    small_out = small_graph.capture(lambda: small.run(planes=1))
    assert len(graph.calls) == 2 and len(small_graph.calls) == 1
    for seq_lens in ([6, 141, 31], [7, 142, 32]):
        params = step.backend.update_meta(step.meta, decode_batch(seq_lens))
        small_params = step.backend.update_meta(small.meta, decode_batch(seq_lens[:2], two))
        assert len(params) == 2 and len(small_params) == 1
        assert small_params[0]["actual_seq_lengths_kv"] == seq_lens[:2]
        graph.update(params)
        small_graph.update(small_params)
        graph.replay()
        small_graph.replay()
        torch.testing.assert_close(out, step.eager(seq_lens), atol=0, rtol=0)
        eager_small = small.run(step.backend.build_meta(decode_batch(seq_lens[:2], two)), small.cache.clone(),
                                planes=1)
        torch.testing.assert_close(small_out, eager_small, atol=0, rtol=0)


def test_graph_without_attention_needs_no_host_params():
    h = hal.get("ascend-sim")
    x = torch.randn(4, 8)
    graph = h.graph()
    out = graph.capture(lambda: x.relu() * 2)
    x.copy_(torch.randn(4, 8))
    graph.update([])
    graph.replay()
    torch.testing.assert_close(out, x.relu() * 2)
    graph.replay()                                               # nothing baked: no update required


def test_staged_host_buffer_copies_only_marked_rows():
    buf = hal.get("ascend-sim").host_buffer((4, 3), torch.int32)
    view = buf.device_view()
    values = torch.randint(1, 100, (4, 3), dtype=torch.int32)
    buf.host.copy_(values)
    buf.mark_dirty(1, 3)
    assert buf.device_view().data_ptr() == view.data_ptr()
    assert torch.equal(view[1:3], values[1:3]) and not view[0].any() and not view[3].any()
    buf.mark_dirty()
    assert torch.equal(buf.device_view(), values)
