"""Golden greedy tokens through the simulated Ascend Hal's paged attention: one packed prefill of all
prompts, then batched decode replayed from one captured graph with a host update before every
replay. A minimal driver stands in for the runtime's engine (which gets the same test when it lands)."""
import pytest
import torch
from helpers import golden_case, golden_names

import hal
import zoo
from hal.base import PagedBatch

BLOCK = 128


class PagedCtx:
    """`zoo.base.ForwardContext` over the backend's paged cache: plane = loop, one cache per layer."""

    def __init__(self, backend, caches, positions):
        self.backend, self.caches, self.positions = backend, caches, positions
        self.meta, self._cache = None, {}

    def cached(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def attend(self, q, k, v, plane, layer, scale):
        self.backend.write_kv(k[0], v[0], self.caches[layer], self.meta, plane)
        return self.backend.forward(q[0], self.caches[layer], self.meta, plane, scale)[None]


def run(model, ids, ctx, num_loops):
    ctx._cache = {}                      # rotary tables follow the (static) positions of this call
    state = model.prelude(ids, ctx)
    for depth in range(num_loops):
        state = model.loop(state, depth, ctx)
    return model.coda(state, ctx)[0]                                        # [T, V]


def generate(model, h, prompts, num_new):
    spec, num_loops = model.kv_spec, model.default_num_loops
    backend = h.attention(model.config.num_attention_heads, spec.num_kv_heads, spec.head_dim, torch.float32)
    assert backend.name == "fia"
    max_blocks = -(-(max(map(len, prompts)) + num_new) // BLOCK)
    num_seqs = len(prompts)
    tables = [[[(p * num_seqs + i) * max_blocks + b for b in range(max_blocks)] for i in range(num_seqs)]
              for p in range(num_loops)]
    caches = [torch.zeros(backend.kv_cache_shape(num_loops * len(prompts) * max_blocks)) for _ in
              range(spec.layers_per_plane)]

    def batch(query_lens, seq_lens):
        return PagedBatch(query_lens, seq_lens, [[t[:-(-s // BLOCK)] for t, s in zip(plane, seq_lens)]
                                                 for plane in tables], BLOCK)

    lens = [len(p) for p in prompts]
    ctx = PagedCtx(backend, caches, torch.tensor([[i for n in lens for i in range(n)]]))
    ctx.meta = backend.build_meta(batch(lens, lens))
    logits = run(model, torch.tensor([[t for p in prompts for t in p]]), ctx, num_loops)
    ends = torch.tensor(lens).cumsum(0) - 1
    tokens = [[t] for t in logits[ends].argmax(-1).tolist()]

    # decode: static inputs, one graph, a host update before every replay
    ids = torch.tensor([[t[-1] for t in tokens]])
    ctx.positions = torch.tensor([lens])
    ctx.meta = backend.build_meta(batch([1] * len(lens), [n + 1 for n in lens]), max_blocks=max_blocks)
    graph = h.graph()
    out = graph.capture(lambda: run(model, ids, ctx, num_loops))
    assert len(graph.calls) == num_loops * spec.layers_per_plane
    for step in range(1, num_new):
        for seq, t in enumerate(out.argmax(-1).tolist()):
            tokens[seq].append(t)
        if step == num_new - 1:
            break
        ids.copy_(torch.tensor([[t[-1] for t in tokens]]))
        ctx.positions.add_(1)
        backend.update_meta(ctx.meta, batch([1] * len(lens), [n + 1 + step for n in lens]))
        graph.update(backend.graph_host_params(ctx.meta))
        graph.replay()
    return tokens


@pytest.mark.parametrize("name", golden_names("ouro"))
def test_golden_greedy_tokens_with_graph_replays(name):
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    h = hal.get("ascend", simulate=True, sim_any_shape=True)      # tiny head dims through the fused path
    prompts = [case.prompt(i) for i in range(case.num_prompts)]
    wanted = [case.greedy(i) for i in range(case.num_prompts)]
    with torch.no_grad():
        got = generate(model, h, prompts, len(wanted[0]))
    assert got == wanted
    assert h.ops.counts["fused_infer_attention"] > 0 and h.ops.counts["scatter_kv"] > 0
