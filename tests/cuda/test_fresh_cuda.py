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
