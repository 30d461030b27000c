"""How many KV blocks the runner allocates: an explicit count, or what the memory budget allows, and
a refusal, naming the setting to change, of a cache larger than the whole device."""
from __future__ import annotations

import logging

from hal.base import Hal
from runtime.config import EngineConfig

log = logging.getLogger(__name__)


def plan_num_blocks(hal: Hal, config: EngineConfig, bytes_per_block: int, max_blocks_useful: int) -> int:
    """KV pool size: explicit, or what the memory budget allows, capped by what could ever be used."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    else:
        free, total = hal.mem_info()
        budget = int(free - total * (1.0 - config.gpu_memory_utilization))
    num_blocks = min(budget // bytes_per_block, max_blocks_useful)
    if num_blocks < 1:
        fix = ("raise engine.kv_cache_memory_bytes" if config.kv_cache_memory_bytes is not None
               else "raise engine.gpu_memory_utilization or set engine.num_kv_blocks")
        raise MemoryError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB, "
                          f"{bytes_per_block} bytes per block); {fix}")
    return int(num_blocks)


def check_cache_fits(config: EngineConfig, num_bytes: int, total_bytes: int, num_blocks: int, block_size: int,
                     free_bytes: int | None = None) -> None:
    """Refuse a KV cache larger than the whole device (an explicit num_kv_blocks or a huge block
    size) by the setting to change, before the allocation fails without one (on the CPU, the kernel
    kills the process). One larger than the memory free now (`free_bytes`) is allocated with a
    warning: the CPU maps its pages as requests first write them, so it fails only once requests
    fill that much."""
    if num_bytes <= total_bytes:
        if free_bytes is not None and num_bytes > free_bytes:
            log.warning("the KV cache takes %.1f GiB (%d blocks of %d tokens), more than the %.1f GiB free now: "
                        "requests that fill it may fail for memory; %s", num_bytes / 2**30, num_blocks, block_size,
                        free_bytes / 2**30, _fix(config))
        return
    raise MemoryError(f"the KV cache would take {num_bytes / 2**30:.1f} GiB ({num_blocks} blocks of {block_size} "
                      f"tokens), more than the device's {total_bytes / 2**30:.1f} GiB: {_fix(config)}")


def _fix(config: EngineConfig) -> str:
    """The setting that sizes a cache too large for the memory."""
    if config.num_kv_blocks is not None:
        return "lower engine.num_kv_blocks, or leave it unset to size the cache by memory"
    if config.kv_cache_memory_bytes is not None:
        return "lower engine.kv_cache_memory_bytes"
    if config.block_size is not None:
        return "lower engine.block_size (or leave it unset for the Hal's own)"
    return "lower engine.max_num_seqs or engine.max_model_len"
