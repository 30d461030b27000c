"""On an NVIDIA GPU: the fresh-prefill modes agree. cuDNN's attention (mode "cudnn", one long
prompt) against torch's flash kernel at the Ouro-1.4B head shape, 8k tokens, bf16."""
import pytest
import torch

from hal.kernels import fresh

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("tokens", [2048, 8192])
def test_cudnn_matches_flash_on_one_long_prompt(tokens):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    starts = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    flash = fresh.attention("flash", q, k, v, starts, [tokens], 128 ** -0.5)
    cudnn = fresh.attention("cudnn", q, k, v, starts, [tokens], 128 ** -0.5)
    if fresh._cudnn_refused:
        pytest.skip(f"cuDNN attention refused: {fresh._cudnn_refused[0][:200]}")
    err = (cudnn.float() - flash.float()).abs().max().item()
    print(f"cudnn vs flash, {tokens} tokens: max abs diff {err:.2e}")
    assert err < 2e-2


def test_cudnn_prefill_over_views_of_one_projection():
    """The engine's case (lever 101): q, k, v views of one q|k|v projection; the rotary/KV-write launch
    hands back q and k rotated and v as the view, then cuDNN attends. Against flash on the same rotated
    operands, and the cache holds k rotated and v."""
    from hal.attention import PagedBatch
    from hal.kernels.backend import TritonPagedAttention
    from hal.kernels.ops import rotary

    tokens, heads, dim, page = 2048, 16, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(tokens, 3 * heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = qkv[:, :heads], qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    backend = TritonPagedAttention(heads, heads, dim, torch.bfloat16, torch.device("cuda"), page,
                                   fresh_attention="cudnn", fresh_min_tokens=0)   # 2,048 tokens: fresh too
    num_blocks = tokens // page
    meta = backend.build_meta(PagedBatch([tokens], [tokens], [[list(range(num_blocks))]], page))
    cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=torch.bfloat16, device="cuda")
    positions = torch.arange(tokens, device="cuda")
    out = backend.attend_rotary(q, k, v, cache, meta, 0, positions, 1e4, False, dim ** -0.5)
    if fresh._cudnn_refused:
        pytest.skip(f"cuDNN attention refused: {fresh._cudnn_refused[0][:200]}")
    q_rot, k_rot = rotary(q, k, positions, 1e4, False, backend.configs)
    flash = fresh.attention("flash", q_rot, k_rot, v, meta.query_start_loc, [tokens], dim ** -0.5)
    err = (out.float() - flash.float()).abs().max().item()
    print(f"cudnn (v a view) vs flash over views, {tokens} tokens: max abs diff {err:.2e}")
    assert err < 2e-2
    assert torch.equal(cache[0].reshape(tokens, heads, dim), k_rot)
    assert torch.equal(cache[1].reshape(tokens, heads, dim), v)
