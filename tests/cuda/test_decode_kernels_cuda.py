"""On an NVIDIA GPU: the decode kernels of issue 19 at the Ouro-1.4B shapes against their torch
definitions (the CPU suite runs the same code in the Triton interpreter at toy shapes): the
projections and their prologues, split-K determinism and graph capture, rotary + KV write, and
prefill without context through torch's flash kernel. Nothing here has run yet."""
import pytest
import torch

import hal
from hal.attention import PagedBatch
from hal.kernels import fresh
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.kv_write import write_kv
from hal.kernels.ops import rms_norm, rotary, silu_and_mul
from hal.kernels.rotary_kv import rotary_kv_write

pytestmark = pytest.mark.cuda

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}


@pytest.fixture(scope="module")
def gpu():
    return hal.get("cuda", decode_projections=True)           # 1-8 rows; by default one row only (gemv_slice)


def _randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_projections_match_the_fp32_product_and_repeat_bit_for_bit(gpu, shape, rows):
    n, k = SHAPES[shape]
    weight, x = _randn(n, k, scale=k ** -0.5), _randn(rows, k)
    linear = gpu.op("linear")
    out = linear(x, weight)
    assert _rel(out, x.float() @ weight.float().T) < 8e-3
    assert torch.equal(out, linear(x, weight))                       # split-K sums in a fixed order
    residual = _randn(rows, n)
    assert _rel(linear(x, weight, residual), residual.float() + (x.float() @ weight.float().T)) < 8e-3


@pytest.mark.parametrize("rows", [1, 4])
def test_prologues_equal_the_unfused_kernels(gpu, rows):
    """A permutation weight returns the prologue's output exactly: it must be what the unfused
    kernels compute (up to an ulp where the row statistics' sum order moves a rounding)."""
    k = 2048
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)[torch.randperm(k, device="cuda")]
    x, res = _randn(rows, k, scale=3), _randn(rows, k)
    w1, w2 = _randn(k), _randn(k)
    pairs = [(gpu.op("rms_norm_linear")(x, w1, 1e-6, eye), rms_norm(x, w1, 1e-6) @ eye.T)]
    y, h = gpu.op("norm_residual_linear")(x, res, w1, w2, 1e-6, eye)
    h_ref = rms_norm(x, w1, 1e-6, res)
    pairs += [(h, h_ref), (y, rms_norm(h_ref, w2, 1e-6) @ eye.T)]
    gate_up = _randn(rows, 2 * k, scale=2)
    pairs.append((gpu.op("silu_mul_linear")(gate_up, eye), silu_and_mul(gate_up) @ eye.T))
    for out, ref in pairs:
        ulp = ref.float().abs().clamp_min(1e-30) * 2 ** -7
        assert ((out.float() - ref.float()).abs() <= ulp * 1.01).all()
        assert (out == ref).float().mean().item() > 0.98


def test_split_k_projection_replays_in_a_graph(gpu):
    n, k = SHAPES["o"]                                                # 128 column blocks: split-K on 132 SMs
    weight, x = _randn(n, k, scale=k ** -0.5), _randn(1, k)
    linear = gpu.op("linear")
    eager = linear(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear(x, weight)
    for _ in range(3):
        graph.replay()
        assert torch.equal(captured, eager)


def test_split_k_projections_on_two_streams_at_once(gpu):
    """Async speculation drafts on a side stream while the verify runs: split-K projections running
    at once on two streams each keep their own arrival counters (with one set, a launch's last split
    could be counted among the other's and sum partials that are not there yet; this kernel-level
    form did not show it on the H200, the engine-level test in test_speculation_cuda.py did)."""
    from hal.kernels import gemv, gemv_ops

    n, k, rows = *SHAPES["down"], 4
    config = gpu.kernel_configs()[gemv.config_key(rows)]
    units = torch.cuda.get_device_properties(0).multi_processor_count
    assert gemv.plan(rows, n, k, config, units).split_k > 1
    linear, side = gpu.op("linear"), torch.cuda.Stream()
    weights = [_randn(n, k, scale=k ** -0.5) for _ in range(2)]
    xs = [_randn(rows, k) for _ in range(2)]
    refs = [linear(x, w) for x, w in zip(xs, weights)]
    side.wait_stream(torch.cuda.current_stream())
    outs: list[list[torch.Tensor]] = [[], []]
    for _ in range(300):
        outs[0].append(linear(xs[0], weights[0]))
        with torch.cuda.stream(side):
            outs[1].append(linear(xs[1], weights[1]))
    torch.cuda.synchronize()
    for ref, out in zip(refs, outs):
        assert sum(not torch.equal(o, ref) for o in out) == 0
    with torch.cuda.stream(side):
        side_counters = gemv_ops.split_counters(xs[0].device)
    assert side_counters is not gemv_ops.split_counters(xs[0].device)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_wide_entry_runs_decode_batches_in_a_graph(shape):
    """A `gemv_wide` entry (not in the sm_90 table: slower than cuBLAS, docs/performance.md lever 53)
    at 64 rows, PDL on and the first weight tile before the wait: the fp32 product, the same bits as
    the launch without the preload, eagerly and replayed in a graph, with SwiGLU in the prologue."""
    from hal.kernels import gemv, gemv_ops
    from hal.kernels.configs import KernelConfig, configs_for
    from hal.kernels.launch import run_launch

    wide = KernelConfig(16, 64, 4, 4, block_k=128, split_k=0)
    ops = gemv_ops.Gemv({**configs_for("sm_90"), "gemv_wide": wide}, max_rows=1)
    n, k = SHAPES[shape]
    weight, x = _randn(n, k, scale=k ** -0.5), _randn(64, k)
    eager = ops.linear(x, weight)
    assert _rel(eager, x.float() @ weight.float().T) < 8e-3
    units = torch.cuda.get_device_properties(0).multi_processor_count
    split = gemv.plan(64, n, k, wide, units, wide=True).split_k
    plain = torch.empty_like(eager)
    run_launch(gemv.gemv_launch(x, weight, plain, KernelConfig(16, 64, 4, 4, block_k=128, split_k=split), "cuda",
                                units, workspace=torch.empty(split * 64 * n, device="cuda"),
                                counters=gemv_ops.split_counters(x.device)))
    assert torch.equal(eager, plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.linear(x, weight)
    graph.replay()
    assert torch.equal(captured, eager)
    if shape == "down":
        gate_up = _randn(64, 2 * k)
        ref = silu_and_mul(gate_up).float() @ weight.float().T
        assert _rel(ops.silu_mul_linear(gate_up, weight), ref) < 8e-3


def test_rotary_kv_write_equals_rotary_then_write_kv(gpu):
    tokens, heads, kv_heads, dim = 8, 16, 16, 128
    qkv = _randn(tokens, heads + 2 * kv_heads, dim)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    positions = torch.randint(0, 60000, (tokens,), device="cuda")
    slots = torch.randperm(256, device="cuda")[:tokens]
    configs = gpu.kernel_configs()
    fused_cache = torch.zeros(2, 16, 16, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    plain_cache = fused_cache.clone()
    q_fused = rotary_kv_write(q, k, v, positions, 1e6, False, fused_cache, slots, configs["rotary"])
    q_plain, k_plain = rotary(q, k, positions, 1e6, False, configs)
    write_kv(k_plain, v, plain_cache, slots, configs["kv_write"])
    assert torch.equal(q_fused, q_plain) and torch.equal(fused_cache, plain_cache)


@pytest.mark.parametrize("lens", [[8192], [1024] * 8, [700, 33, 2000]])
def test_fresh_prefill_matches_the_paged_kernel(gpu, lens):
    chosen = gpu.attention(16, 16, 128, torch.bfloat16)
    assert chosen.fresh_attention in ("flash", "cudnn")      # cudnn (sm_90 on) takes the 8k prompt
    assert chosen.caps.fresh_min_tokens == fresh.MIN_TOKENS
    # every batch here on the fresh path, shorter prompts too (the engine's own K/V below MIN_TOKENS), several
    # prompts through flash ("cudnn" takes one prompt alone)
    mode = chosen.fresh_attention if len(lens) == 1 else "flash"
    backend = TritonPagedAttention(16, 16, 128, torch.bfloat16, chosen.device, 16, configs=chosen.configs,
                                   fresh_attention=mode, fresh_min_tokens=0)
    paged = TritonPagedAttention(16, 16, 128, torch.bfloat16, backend.device, 16, configs=backend.configs)
    page, tables, nxt = 16, [], 0
    for n in lens:
        tables.append(list(range(nxt, nxt + -(-n // page))))
        nxt += -(-n // page)
    batch = PagedBatch(lens, lens, [tables], page)
    q, k, v = _randn(sum(lens), 16, 128), _randn(sum(lens), 16, 128), _randn(sum(lens), 16, 128)
    caches = [torch.zeros(backend.kv_cache_shape(nxt), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    meta = backend.build_meta(batch)
    assert meta.fresh_lens == tuple(lens)
    out = backend.attend(q, k, v, caches[0], meta, 0, 128 ** -0.5)
    ref = paged.attend(q, k, v, caches[1], paged.build_meta(batch), 0, 128 ** -0.5)
    assert torch.equal(caches[0], caches[1])
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("lens", [[300], [129, 700, 17, 1000]], ids=["b1", "b4"])
@pytest.mark.parametrize("heads,kv_heads,dim,interleaved", [(16, 16, 128, False), (55, 55, 96, True),
                                                             (48, 8, 128, False)], ids=["ouro", "huginn", "nanbeige"])
def test_small_decode_batches_rotate_inside_the_row_kernel(gpu, heads, kv_heads, dim, interleaved, lens):
    """Decode at batch 1 and 4 at the three families' head shapes (Nanbeige's grouped queries take the
    row kernel there too): `attend_rotary` (the row kernel rotating and storing this step's K/V) stores
    the bytes of `rotary_kv_write` and attends as the two launches do. Both compile without
    floating-point contraction (`launch.EXACT_ROUNDING`): with it, 219-4,300 of the rotated keys
    came out one bf16 ulp apart on the H200 (2026-12-03; docs/performance.md, lever 66)."""
    from hal.common.torch_attention import TorchPagedAttention

    backend = gpu.attention(heads, kv_heads, dim, torch.bfloat16)
    page, tables, nxt = 16, [], 0
    for n in lens:
        tables.append(list(range(nxt, nxt + -(-n // page))))
        nxt += -(-n // page)
    history = PagedBatch([n - 1 for n in lens], [n - 1 for n in lens], [tables], page)
    step = PagedBatch([1] * len(lens), lens, [tables], page)
    cache = torch.zeros(backend.kv_cache_shape(nxt), device="cuda", dtype=torch.bfloat16)
    num_old = sum(lens) - len(lens)
    backend.write_kv(_randn(num_old, kv_heads, dim), _randn(num_old, kv_heads, dim), cache,
                     backend.build_meta(history), 0)
    meta = backend.build_meta(step)
    q = _randn(len(lens), heads, dim)
    k, v = _randn(len(lens), kv_heads, dim), _randn(len(lens), kv_heads, dim)
    positions = torch.tensor(lens, device="cuda") - 1
    fused_cache, plain_cache = cache.clone(), cache.clone()
    fused = backend.attend_rotary(q, k, v, fused_cache, meta, 0, positions, 1e4, interleaved, dim ** -0.5)
    values_view, _ = backend._views(plain_cache)
    q_rot = rotary_kv_write(q, k, v, positions, 1e4, interleaved, values_view, meta.slot_mapping[0],
                            backend.configs["rotary"])
    plain = backend.forward(q_rot, plain_cache, meta, 0, dim ** -0.5)
    cpu = torch.device("cpu")
    reference = TorchPagedAttention(heads, kv_heads, dim, torch.float32, cpu, page)
    ref = reference.forward(q_rot.float().cpu(), plain_cache.float().cpu(), reference.build_meta(step), 0,
                            dim ** -0.5)
    slots = meta.slot_mapping[0]
    apart = (fused_cache[0].flatten(0, 1)[slots] != plain_cache[0].flatten(0, 1)[slots]).sum().item()
    errors = (apart, _rel(fused, plain), _rel(plain.cpu(), ref), _rel(fused.cpu(), ref))
    print("row kernel rotary", heads, kv_heads, dim, interleaved, lens, errors)
    assert torch.equal(fused_cache, plain_cache), errors
    assert max(errors[1:]) < 1e-2, errors


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, None], ids=["fp8", "bf16"])
@pytest.mark.parametrize("num_seqs", [16, 64, 128])
def test_grouped_decode_on_the_tma_kernel(gpu, num_seqs, kv_dtype):
    """Nanbeige's grouped queries past a few sequences on hal/kernels/gqa_decode.py (TMA page copies):
    as close to the float32 reference over the same cache as the unified kernel is, the same in a
    CUDA graph as eagerly (also after the lengths change in place), and no NaN from the cache's
    never-written slots (filled with NaN bytes)."""
    from hal.common.torch_attention import TorchPagedAttention
    from hal.kernels import attend

    key = attend.GQA_TMA_KEY + ("_fp8" if kv_dtype else "")
    base = gpu.attention(48, 8, 128, torch.bfloat16, kv_dtype=kv_dtype)
    configs = base.configs
    assert key in configs
    backend = TritonPagedAttention(48, 8, 128, torch.bfloat16, base.device, 16, kv_dtype=kv_dtype, configs=configs)
    unified = TritonPagedAttention(48, 8, 128, torch.bfloat16, base.device, 16, kv_dtype=kv_dtype,
                                   configs={k: c for k, c in configs.items() if not k.startswith(attend.GQA_TMA_KEY)})
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 1200, (num_seqs,), generator=gen).tolist()
    page, tables, nxt = 16, [], 0
    order = torch.randperm(sum(-(-n // page) for n in lens), generator=gen).tolist()
    for n in lens:
        tables.append(order[nxt:nxt + -(-n // page)])
        nxt += -(-n // page)
    history = PagedBatch(lens, lens, [tables], page)
    step = PagedBatch([1] * num_seqs, lens, [tables], page)
    cache = torch.full(backend.kv_cache_shape(nxt), 0x7F if kv_dtype else float("nan"), device="cuda",
                       dtype=torch.uint8 if kv_dtype else torch.bfloat16)
    backend.write_kv(_randn(sum(lens), 8, 128), _randn(sum(lens), 8, 128, scale=3.0), cache,
                     backend.build_meta(history), 0)
    q = _randn(num_seqs, 48, 128)
    meta = backend.build_meta(step)
    launches = attend.launches_for(q, *backend._views(cache)[:1], meta.block_tables[0], meta.seq_lens,
                                   meta.query_start_loc, 1, 0.1, configs, 132, torch.empty_like(q),
                                   backend._views(cache)[1])
    assert launches[0].kernel.fn.__name__ == "_gqa_decode_kernel", key
    out = backend.forward(q, cache, meta, 0, 128 ** -0.5)
    base_out = unified.forward(q, cache, unified.build_meta(step), 0, 128 ** -0.5)
    graph, static_out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        static_out = backend.forward(q, cache, meta, 0, 128 ** -0.5)
    graph.replay()
    assert torch.equal(static_out, out)
    # the next step's lengths in the same buffers: the graph reads them, nothing was baked in at capture
    meta.seq_lens.copy_((meta.seq_lens - 7).clamp(min=1))
    graph.replay()
    assert torch.equal(static_out, backend.forward(q, cache, meta, 0, 128 ** -0.5))
    cpu = torch.device("cpu")
    reference = TorchPagedAttention(48, 8, 128, torch.float32, cpu, page, kv_dtype=kv_dtype)
    ref_cache = cache.cpu() if kv_dtype else cache.float().cpu()
    ref = reference.forward(q.float().cpu(), ref_cache, reference.build_meta(step), 0, 128 ** -0.5)
    errors = (_rel(out.cpu(), ref), _rel(base_out.cpu(), ref), _rel(out, base_out))
    print("gqa tma decode", key, num_seqs, errors)
    assert torch.isfinite(out).all()
    assert errors[0] < 1e-2 and errors[0] < 2 * errors[1] + 1e-3, errors


@pytest.mark.parametrize("block_n,block_k,warps,rows", [(64, 512, 4, 1), (64, 256, 4, 1), (128, 256, 4, 1),
                                                         (64, 1024, 4, 1), (128, 256, 4, 8)])
def test_tensor_core_slice_at_ouro_shapes(block_n, block_k, warps, rows, gpu):
    """Lever 119's slices on the tensor cores (each row of x a column of wgmma's second operand; one row
    or a decode batch of 8) against the float64 product at Ouro-1.4B's four shapes, SwiGLU prologue and
    residual epilogue on down."""
    from hal.kernels import gemv
    from hal.kernels.configs import KernelConfig
    from hal.kernels.gemv_slice import num_splits, slice_gemv_launch
    from hal.kernels.launch import run_launch

    config = KernelConfig(16 if rows > 1 else 1, block_n, warps, 1, block_k=block_k)
    for n, k in ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)):
        swiglu = k == 5632
        weight = _randn(n, k, scale=k ** -0.5)
        x = _randn(rows, 2 * k if swiglu else k)
        residual = _randn(rows, n) if swiglu else None
        a = silu_and_mul(x) if swiglu else x
        out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
        splits = num_splits(k, config)
        run_launch(slice_gemv_launch(x, weight, out, config, "cuda", prologue=gemv.SILU_AND_MUL if swiglu else gemv.NONE,
                                     out_residual=residual, workspace=torch.empty(splits * rows * n, device=x.device),
                                     counters=torch.zeros(n, dtype=torch.int32, device=x.device), tensor_cores=True))
        ref = a.double() @ weight.double().T + (0 if residual is None else residual.double())
        rel = _rel(out, ref)
        print(f"tc slice {rows} x {n}x{k} bn{block_n} bk{block_k} w{warps}: rel {rel:.2e}")
        assert rel < 5e-3
