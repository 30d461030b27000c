"""Eager steps of new sizes compile nothing new (hal/kernels/launch.py): the kernels an eager step
launches take the same Triton specialisation whatever the batch's token count, sequence count and
block-table width, so a GPU never compiles a variant inside a step after the first."""
from __future__ import annotations

import sys
from collections import defaultdict

import torch

import zoo
from hal.kernels.launch import Launch, run_launch
from helpers import golden_case
from interp import interpreter
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from triton_hal import TritonOnCpu
from xcompile import TARGETS, bind_launch

STEP_KERNELS = ("_paged_attention_kernel", "_kv_write_kernel", "_reduce_splits_kernel")


def specialisation(launch: Launch) -> tuple:
    """What Triton's launcher keys a compiled variant on besides the constexprs (sm_90's binder)."""
    return tuple(bind_launch(launch, TARGETS["sm_90"]).specialization)


def _record_launches(monkeypatch) -> list[Launch]:
    launches: list[Launch] = []

    def recording(launch: Launch) -> None:
        launches.append(launch)
        run_launch(launch)

    for name, module in list(sys.modules.items()):
        if name.startswith("hal.") and getattr(module, "run_launch", None) is run_launch:
            monkeypatch.setattr(module, "run_launch", recording)
    return launches


def test_eager_steps_of_any_size_share_one_variant_per_config(monkeypatch):
    case = golden_case("ouro-tiny-gqa-bf16")
    model = zoo.from_pretrained(case.path, dtype="float32")
    launches = _record_launches(monkeypatch)
    # steps of 1, 2, 3 and 16 sequences; 16, 17, 31 and 48 tokens; tables 1 to 17 blocks wide
    waves = [[16], [17], [3, 13, 15], [1] * 16, [31, 17], [66]]
    with interpreter(), torch.inference_mode():
        engine = LLMEngine(model, TritonOnCpu(), EngineConfig(block_size=4, max_num_batched_tokens=48, num_kv_blocks=256,
                                                              graphs=False))
        for wave, lengths in enumerate(waves):
            for i, n in enumerate(lengths):
                prompt = [(7 * wave + 3 * i + j) % 150 + 3 for j in range(n)]
                engine.add_request(f"{wave}.{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                                            ignore_eos=True))
            engine.run_until_done()
    variants: dict[tuple, set] = defaultdict(set)
    sizes: dict[tuple, set] = defaultdict(set)
    for launch in launches:
        name = launch.kernel.fn.__name__
        if name in STEP_KERNELS:
            config = (name, tuple(sorted((k, str(v)) for k, v in launch.kwargs.items())))
            variants[config].add(specialisation(launch))
            sizes[config].add(launch.grid)
    assert {config[0] for config in variants} >= {"_paged_attention_kernel", "_kv_write_kernel"}
    prefill = [c for c in variants if c[0] == "_paged_attention_kernel" and ("NUM_SPLITS", "1") in c[1]]
    assert prefill and max(len(sizes[c]) for c in prefill) >= 4, "the waves did not vary the step's sizes"
    for config, seen in variants.items():
        assert len(seen) == 1, f"{config[0]} compiles {len(seen)} variants for one config: {seen}"


def test_a_step_size_changes_no_launch_key():
    """The flags reach the runtime's key: the KV write's and the W8A16 linear's launches at 1, 16 and
    17 tokens key alike."""
    from hal.kernels.configs import all_configs
    from hal.kernels.fp8_linear import fp8_linear_launch
    from hal.kernels.kv_write import kv_write_launch

    configs = all_configs()["sm_90"]
    writes, linears = set(), set()
    for num_tokens in (1, 16, 17):
        k = torch.empty(num_tokens, 2, 8)
        slots = torch.zeros(num_tokens, dtype=torch.int64)
        writes.add(specialisation(kv_write_launch(k, k, torch.empty(2, 4, 4, 2, 8), slots, configs["kv_write"],
                                                  "cuda")))
        x, weight = torch.empty(num_tokens, 64, dtype=torch.bfloat16), torch.empty(32, 64, dtype=torch.float8_e4m3fn)
        linears.add(specialisation(fp8_linear_launch(x, weight, torch.empty(32), None,
                                                     torch.empty(num_tokens, 32, dtype=torch.bfloat16),
                                                     configs["fp8_linear"], "cuda")))
    assert len(writes) == 1 and len(linears) == 1
