"""`SimNpu`: the torch_npu ops the Ascend Hal calls, simulated on the CPU, with the same names and
the same schemas (every call is bound through `hal.ascend.schemas`), so `hal.ascend.ops` runs
unchanged against it.

It also simulates what `torch.npu.graph(..., auto_dispatch_capture=True)` does to the updatable
ops: while a graph captures, each fused-attention / paged-attention call is recorded with its host
arguments; `SimGraph.update` replaces them as `NPUGraph.update(cpu_update_input=...)` does; an
eager replay then runs those ops with the *recorded* host arguments, not the ones the Python code
passes, exactly as a real replay would. So a forgotten or wrong update gives wrong numbers here too.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, NamedTuple

import torch

from hal.ascend.sim import attention as sim_attention
from hal.ascend.schemas import bind, parsed
from hal.ascend.sim.attention import NpuOpError, require

# the host arguments torch_npu 2.13's graph handlers let an update replace, per op
GRAPH_UPDATABLE = {"npu_fused_infer_attention_score": ("actual_seq_lengths", "actual_seq_lengths_kv"),
                   "_npu_paged_attention": ("context_lens",)}


class SimRecord(NamedTuple):
    op: str
    host_args: dict[str, Any]          # the updatable arguments, as captured or last updated


class GraphReplayError(RuntimeError):
    """A simulated replay that does not match its capture (missing update, different op sequence)."""


def _simulated(op: str, covered: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Bind the call to the op's schema; refuse non-default values of arguments the simulation does
    not cover (everything not in `covered` when `covered` is given)."""
    def wrap(impl: Callable[..., Any]) -> Callable[..., Any]:
        def op_fn(self: "SimNpu", *args: Any, **kwargs: Any) -> Any:
            bound = bind(op, args, kwargs)
            if covered:
                for arg in parsed(op).arguments:
                    value = bound[arg.name]
                    if arg.name not in covered and not _is_default(value, arg.default_value):
                        raise NotImplementedError(f"{op}: argument {arg.name} is not simulated")
            if op in GRAPH_UPDATABLE:
                bound = self._graph_host_args(op, bound)
            return impl(self, bound)
        op_fn.__name__ = op
        return op_fn
    return wrap


def _is_default(value: Any, default: Any) -> bool:
    return value is None if default is None else (not isinstance(value, torch.Tensor) and value == default)


class SimNpu:
    """Drop-in for the `torch_npu` module as `hal.ascend.ops` uses it (CPU tensors)."""

    __version__ = "simulated"

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict                            # hardware shape limits of the fused path
        self._capture: list[SimRecord] | None = None
        self._replay: Iterator[SimRecord] | None = None

    # ----- attention and KV -------------------------------------------------------------------
    @_simulated("npu_fused_infer_attention_score", covered=(
        "query", "key", "value", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table",
        "num_heads", "scale", "pre_tokens", "next_tokens", "input_layout", "num_key_value_heads",
        "sparse_mode", "block_size", "inner_precise", "softmax_lse_flag", "key_antiquant_scale",
        "value_antiquant_scale", "key_antiquant_mode", "value_antiquant_mode"))
    def npu_fused_infer_attention_score(self, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if a["key_antiquant_scale"] is not None or a["value_antiquant_scale"] is not None:
            return sim_attention.fused_infer_attention_antiquant(a, self.strict)
        return sim_attention.fused_infer_attention(a, self.strict)

    @_simulated("_npu_paged_attention")
    def _npu_paged_attention(self, a: dict[str, Any]) -> None:
        require(a["workspace"] is None, "_npu_paged_attention", "workspace is not simulated")
        sim_attention.paged_attention(a, self.strict)

    @_simulated("npu_scatter_pa_kv_cache")
    def npu_scatter_pa_kv_cache(self, a: dict[str, Any]) -> None:
        sim_attention.scatter_pa_kv_cache(a, self.strict)

    # ----- norms, rotary, activation ----------------------------------------------------------
    @_simulated("npu_rms_norm")
    def npu_rms_norm(self, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return _rms_norm("npu_rms_norm", a["input"], a["gamma"], a["epsilon"])

    @_simulated("npu_add_rms_norm")
    def npu_add_rms_norm(self, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x1, x2 = a["x1"], a["x2"]
        require(x1.shape == x2.shape and x1.dtype == x2.dtype, "npu_add_rms_norm", "x1 and x2 must match")
        x_sum = (x1.float() + x2.float()).to(x1.dtype)
        y, rstd = _rms_norm("npu_add_rms_norm", x_sum, a["gamma"], a["epsilon"])
        return y, rstd, x_sum

    @_simulated("npu_apply_rotary_pos_emb")
    def npu_apply_rotary_pos_emb(self, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        op, q, k, cos, sin = "npu_apply_rotary_pos_emb", a["query"], a["key"], a["cos"], a["sin"]
        layout, mode = a["layout"], a["rotary_mode"]
        require(layout in ("BSND", "TND"), op, f"layout {layout!r}: Atlas A2 takes BSND or TND")
        rank = 4 if layout == "BSND" else 3
        require(q.dim() == k.dim() == cos.dim() == sin.dim() == rank, op, f"{layout} tensors: {rank}-D")
        lead, head_dim = q.shape[:rank - 2], q.shape[-1]
        table_shape = (*lead, 1, head_dim)
        require(k.shape[:rank - 2] == lead and k.shape[-1] == head_dim, op, "query and key shapes differ")
        require(cos.shape == sin.shape == table_shape, op, f"cos/sin: {table_shape}, not {tuple(cos.shape)}")
        require(q.dtype == k.dtype == cos.dtype == sin.dtype, op, "query, key, cos, sin: one dtype")
        require(mode == "half" or not self.strict, op, f"rotary_mode {mode!r}: Atlas A2 takes 'half' only")
        require(head_dim in (64, 128) or not self.strict, op, f"head dim {head_dim}: Atlas A2 takes 64, 128")
        q.copy_(_rotate(q, cos, sin, mode))                   # the kernel updates query and key in place
        k.copy_(_rotate(k, cos, sin, mode))
        return q, k

    @_simulated("npu_rotary_mul")
    def npu_rotary_mul(self, a: dict[str, Any]) -> torch.Tensor:
        op, x, r1, r2, mode = "npu_rotary_mul", a["input"], a["r1"], a["r2"], a["rotary_mode"]
        require(a["rotate"] is None, op, "the rotate matrix is not simulated")
        require(x.dim() == r1.dim() == r2.dim() == 4 and r1.shape == r2.shape, op, "input, r1, r2: 4-D")
        require(mode in ("half", "interleave"), op, f"rotary_mode {mode!r}: 'half' or 'interleave'")
        require(x.shape[-1] % 2 == 0 and x.shape[-1] < 896, op, f"head dim {x.shape[-1]}: even, < 896")
        require(all(r in (1, s) for r, s in zip(r1.shape, x.shape)) and r1.shape[-1] == x.shape[-1], op,
                f"r1 {tuple(r1.shape)} does not broadcast to input {tuple(x.shape)}")
        if mode == "interleave":
            require(r1.shape[0] == 1 and r1.shape[2] == 1, op, "interleave mode takes r1/r2 as 1S1D (BSND)")
        return _rotate(x, r1, r2, mode)

    @_simulated("npu_swiglu")
    def npu_swiglu(self, a: dict[str, Any]) -> torch.Tensor:
        x, dim = a["input"], a["dim"]
        require(x.shape[dim] % 2 == 0, "npu_swiglu", f"dim {dim} of {tuple(x.shape)} must be even")
        gate, up = x.float().chunk(2, dim=dim)
        return (torch.nn.functional.silu(gate) * up).to(x.dtype)

    # ----- graph capture / replay -------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self, records: list[SimRecord]) -> Iterator[None]:
        """Record the updatable ops called inside the block (as auto_dispatch_capture does)."""
        if self._capture is not None or self._replay is not None:
            raise RuntimeError("one graph capture or replay at a time")
        self._capture = records
        try:
            yield
        finally:
            self._capture = None

    @contextlib.contextmanager
    def replaying(self, records: list[SimRecord]) -> Iterator[None]:
        """Feed the recorded host arguments to the updatable ops called inside the block, in order."""
        if self._capture is not None or self._replay is not None:
            raise RuntimeError("one graph capture or replay at a time")
        feed = iter(records)
        self._replay = feed
        try:
            yield
            extra = next(feed, None)
            if extra is not None:
                raise GraphReplayError(f"replay issued fewer updatable ops than captured ({extra.op} left)")
        finally:
            self._replay = None

    def _graph_host_args(self, op: str, bound: dict[str, Any]) -> dict[str, Any]:
        keys = GRAPH_UPDATABLE[op]
        if self._capture is not None:
            self._capture.append(SimRecord(op, {k: copy.deepcopy(bound[k]) for k in keys}))
        elif self._replay is not None:
            record = next(self._replay, None)
            if record is None or record.op != op:
                raise GraphReplayError(f"replay called {op} where the capture had "
                                       f"{record.op if record else 'nothing more'}")
            bound = {**bound, **record.host_args}
        return bound


def _rms_norm(op: str, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    require(gamma.dtype == x.dtype, op, f"gamma dtype {gamma.dtype} must equal the input's {x.dtype}")
    require(2 <= x.dim() <= 8 and x.shape[x.dim() - gamma.dim():] == gamma.shape, op,
            f"gamma {tuple(gamma.shape)} must be the trailing dims of the input {tuple(x.shape)}")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dims, keepdim=True) + eps)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def _rotate(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> torch.Tensor:
    """`r1 * x + r2 * rotate(x)` in float32 (torch_npu's formula for both modes)."""
    x32 = x.float()
    if mode == "half":
        x1, x2 = x32.chunk(2, dim=-1)
        turned = torch.cat([-x2, x1], dim=-1)
    else:
        turned = torch.stack([-x32[..., 1::2], x32[..., ::2]], dim=-1).flatten(-2)
    return (r1.float() * x32 + r2.float() * turned).to(x.dtype)


__all__ = ["GRAPH_UPDATABLE", "GraphReplayError", "NpuOpError", "SimNpu", "SimRecord"]
