"""What `LLM()` takes besides the engine options, checked with the fix named: vLLM's constructor
arguments (`seed`, `trust_remote_code`, `tensor_parallel_size`, ...), a tokenizer folder, and what it
derives: the global seeding and the checkpoint's generation_config sampling defaults."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
import random
from pathlib import Path
from numbers import Integral
from typing import Any, Mapping

import numpy as np
import torch

from runtime.config import EngineConfig
from runtime.parallel.state import ParallelState
from runtime.text.tokenizer import Tokenizer

log = logging.getLogger("runtime.llm")


def check_seed(seed: Any) -> int | None:
    """`seed` as Python's int (a NumPy integer too), or None."""
    if seed is None:
        return None
    if not (isinstance(seed, Integral) and not isinstance(seed, (bool, np.bool_)) and 0 <= seed < 2 ** 63):
        raise ValueError(f"seed must be an integer in [0, 2^63) (or None), got {seed!r}")
    return int(seed)


# vLLM's constructor arguments that `LLM.__init__` takes besides the EngineConfig fields
VLLM_OPTIONS = ("seed", "trust_remote_code", "tensor_parallel_size", "enforce_eager", "tokenizer")


def check_engine_keywords(engine_options: Mapping[str, Any]) -> None:
    """A TypeError naming the keyword and the options there are, not EngineConfig's bare one."""
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    for name in engine_options:
        if name not in fields:
            close = difflib.get_close_matches(name, fields + list(VLLM_OPTIONS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}. It takes model, hal, "
                            f"dtype, tokenizer, engine_config, parallel, stop_token_ids; vLLM's "
                            f"{', '.join(VLLM_OPTIONS[:-1])}; and the engine options of "
                            f"runtime.config.EngineConfig: {', '.join(fields)}")


@functools.cache
def note_remote_code_unused() -> None:
    log.info("trust_remote_code=True is not needed: loopstack runs its own implementation of the model "
             "(zoo/), no code from the checkpoint")


def check_tensor_parallel_size(size: Any, parallel: ParallelState) -> None:
    """vLLM starts its tensor-parallel workers itself; here they are torchrun's processes, so past
    the default 1 only the size `parallel` already has is accepted."""
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if size in (1, parallel.world_size):
        return
    raise ValueError(
        f"tensor_parallel_size={size}, but LLM() does not start tensor-parallel workers: loopstack runs one "
        f"process per rank under torchrun (docs/tensor-parallel.md). From the command line: `torchrun "
        f"--nproc-per-node {size} -m runtime.generate model=... parallel.tp={size}` (runtime.serve and "
        f"runtime.bench alike). From a script started by `torchrun --nproc-per-node {size}`: `parallel = "
        f"runtime.parallel.state.init_distributed(hal, {size})`, then `LLM(model, hal=hal, "
        f"parallel=parallel)` on rank 0 (parallel.is_driver) and `runtime.llm.follow(model, hal, dtype, "
        f"parallel)` on the others")


def tokenizer_at(path: str | os.PathLike) -> Tokenizer:
    folder = Path(path).expanduser()
    tokenizer = Tokenizer.from_folder(folder) if folder.is_dir() else None
    if tokenizer is None:
        what = "has no tokenizer.json" if folder.is_dir() else "is not a folder"
        raise ValueError(f"tokenizer={os.fspath(path)!r} {what}: give the folder that holds a tokenizer.json "
                         f"(e.g. the checkpoint's) or a runtime.text.tokenizer.Tokenizer")
    return tokenizer


def seed_global_rngs(seed: int) -> None:
    """vLLM's seeding: Python's, NumPy's and torch's (every device's) global generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % (1 << 32))           # NumPy's legacy seeds are 32-bit


def sampling_of_generation_config(folder: str | os.PathLike | None) -> dict[str, Any]:
    """The sampling fields of a checkpoint's generation_config.json that SamplingParams takes."""
    path = Path(folder) / "generation_config.json" if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: raw[k] for k in keys if raw.get(k) is not None}
