"""Tensor-parallel process groups, from torchrun's environment.

    torchrun --nproc-per-node 2 -m runtime.generate model=ouro-1.4b parallel.tp=2 prompt="..."

`init_distributed(hal, tp)` joins the process group of the Hal's `dist_backend` (nccl, rccl as nccl,
hccl, gloo) on device `LOCAL_RANK`. Two channels come out of it: the Hal's `Comm` over the world
group, which the model's all-reduces and all-gathers use; and a `ControlChannel` over a separate
gloo group, on which rank 0 (the driver: scheduler, tokenizer, outputs) sends pickled messages
(`runtime.parallel.step_plan`) to the other ranks, which only execute. Plans stay on the host, never in the
device's stream, and the gloo group gets a long timeout because a follower waits for as long as a
server idles.
"""
from __future__ import annotations

import logging
import os
import pickle
from datetime import timedelta
from typing import Any

import torch

from hal.base import Hal
from hal.common.comm import TorchDistComm
from zoo.parallel import tensor_parallel

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT_S = 7 * 24 * 3600.0


class ControlChannel:
    """Rank 0 -> every rank: one pickled message per `send`, received in order by `recv`. A message
    that fits `FRAME_BYTES` (every decode step's plan) takes one broadcast; larger ones a second."""

    FRAME_BYTES = 16 << 10
    HEADER_BYTES = 8

    def __init__(self, group: Any) -> None:
        self.group = group
        self.comm = TorchDistComm(group)
        self.frame = torch.zeros(self.FRAME_BYTES, dtype=torch.uint8)

    def send(self, message: Any) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = self.FRAME_BYTES - self.HEADER_BYTES
        self.frame[:self.HEADER_BYTES] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        first = payload[:head]
        self.frame[self.HEADER_BYTES:self.HEADER_BYTES + len(first)] = torch.frombuffer(bytearray(first),
                                                                                         dtype=torch.uint8)
        self.comm.broadcast(self.frame, src=0)
        if len(payload) > head:
            self.comm.broadcast(torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8), src=0)

    def recv(self) -> Any:
        frame = self.comm.broadcast(self.frame, src=0)
        size = int(frame[:self.HEADER_BYTES].view(torch.int64))
        head = self.FRAME_BYTES - self.HEADER_BYTES
        payload = frame[self.HEADER_BYTES:self.HEADER_BYTES + min(size, head)].numpy().tobytes()
        if size > head:
            rest = self.comm.broadcast(torch.empty(size - head, dtype=torch.uint8), src=0)
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)


class ParallelState:
    """This process's place in a tensor-parallel run (`world_size == 1`: a plain single-device run)."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, comm: Any = None,
                 channel: Any = None, owns_group: bool = False) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.comm = comm              # the Hal's Comm over the world group (model collectives)
        self.channel = channel        # ControlChannel (rank 0 -> others), None when world_size == 1
        self.owns_group = owns_group  # init_distributed created the world group (shutdown destroys it)
        self._closed = False
        self._following = True        # driver: whether the followers are in `Follower.run`

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, tokenizes and prints; the other ranks follow its step plans."""
        return self.rank == 0

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def shard_args(self) -> dict[str, Any]:
        """Keyword arguments for `zoo.from_pretrained` / `zoo.from_config`."""
        if not self.is_parallel:
            return {}
        return {"tp_rank": self.rank, "tp_size": self.world_size, "comm": self.comm}

    def publisher(self, seed: int | None = None) -> Any:
        """The driver's `PlanPublisher` for an `LLMEngine` (None on one rank); `seed` as there."""
        if not (self.is_parallel and self.is_driver):
            return None
        from runtime.parallel.step_plan import PlanPublisher

        self._following = True
        return PlanPublisher(self.channel, seed)

    def stop_followers(self) -> None:
        """Driver: make the other ranks' `follow(...)` return, e.g. to load another model next."""
        if self.is_parallel and self.is_driver and self._following:
            from runtime.parallel.step_plan import StopFollowing

            self.channel.send(StopFollowing())
            self._following = False

    def shutdown(self) -> None:
        """Driver: stop the followers. Every rank: leave the process groups this state created (the
        world group only if `init_distributed` created it). Idempotent."""
        if self._closed or not self.is_parallel:
            return
        self._closed = True
        self.stop_followers()
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if self.owns_group:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(self.channel.group)


def init_distributed(hal: Hal, tp: int, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                     environ: dict[str, str] | None = None,
                     collective_timeout_s: float | None = None) -> ParallelState:
    """Join torchrun's process group for `tp`-way tensor parallelism (tp=1 outside torchrun: a
    single-process state, nothing initialised). Raises a ValueError that names the fix when tp and
    the launch disagree. `collective_timeout_s`: how long a model collective may wait before the
    backend aborts (None: torch's default, 10 minutes on NCCL)."""
    env = os.environ if environ is None else environ
    if tp < 1:
        raise ValueError(f"parallel.tp must be >= 1, got {tp}")
    world_size = int(env.get("WORLD_SIZE", "1"))
    if tp == 1 and world_size == 1:
        return ParallelState()
    if "RANK" not in env:
        raise ValueError(f"parallel.tp={tp} needs one process per rank: launch with `torchrun "
                         f"--nproc-per-node {tp} -m runtime.<generate|serve|bench> ... parallel.tp={tp}`")
    if world_size != tp:
        raise ValueError(f"torchrun started WORLD_SIZE={world_size} processes but parallel.tp={tp}; tensor "
                         f"parallelism is the only split, so they must be equal (--nproc-per-node {tp})")
    rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
    _bind_device(hal, local_rank)
    import torch.distributed as dist

    owns_group = not dist.is_initialized()          # a script may have joined the group already
    if owns_group:
        timeout = {} if collective_timeout_s is None else {"timeout": timedelta(seconds=collective_timeout_s)}
        dist.init_process_group(backend=hal.dist_backend, rank=rank, world_size=world_size, **timeout)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=idle_timeout_s))
    log.info("tensor parallel rank %d of %d on %s (%s)", rank, world_size, hal.device(), hal.dist_backend)
    return ParallelState(rank, world_size, local_rank, hal.comm(), ControlChannel(control), owns_group)


def init_from_cli(hal: Hal, cfg: Any) -> ParallelState:
    """`init_distributed` from a CLI config's `parallel` node (`runtime.config.ParallelConfig`; absent:
    tp=1). Ranks other than 0 log errors only, so the output is rank 0's."""
    node = getattr(cfg, "parallel", None)
    tp = int(node.tp) if node is not None else 1
    timeout = float(node.idle_timeout_s) if node is not None else DEFAULT_IDLE_TIMEOUT_S
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
    return init_distributed(hal, tp, timeout)


def _bind_device(hal: Hal, local_rank: int) -> None:
    """Device index = local rank. Processes share the one device only on gloo (the CPU)."""
    count = hal.device_count()
    if local_rank < count:
        hal.set_device(local_rank)
    elif hal.dist_backend != "gloo":
        raise ValueError(f"local rank {local_rank} has no device: hal {hal.name} sees {count}; start at "
                         f"most {count} processes per node (torchrun --nproc-per-node) or make more devices "
                         f"visible ({hal.visible_devices_env})")


def agree_min(model: Any, value: int, device: torch.device) -> int:
    """The smallest `value` over the model's tensor-parallel ranks (the KV pool must have the same
    number of blocks everywhere, since block ids travel in step plans); `value` on one rank."""
    tp = tensor_parallel(model)
    if tp is None or tp.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    tp.comm.all_reduce(t, "min")
    return int(t.item())


def capture_allowed(hal: Hal, model: Any, requested: bool | None) -> bool:
    """Whether decode graphs are captured: `requested`, or by default where the Hal records device
    work. A sharded model's step contains collectives, which only Hals with `caps.graph_collectives`
    capture (NCCL on CUDA); elsewhere the same padded path runs eagerly."""
    capture = hal.caps.graphs if requested is None else requested
    tp = tensor_parallel(model)
    if capture and tp is not None and tp.world_size > 1 and not hal.caps.graph_collectives:
        if requested:
            raise ValueError(f"graphs=true with tensor parallelism, but hal {hal.name} cannot capture "
                             f"collectives in graphs; leave graphs unset (the padded decode path then runs "
                             f"eagerly)")
        log.info("hal %s cannot capture collectives: tensor-parallel decode steps run eagerly", hal.name)
        return False
    return capture
