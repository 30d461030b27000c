"""`python -m hal.ascend.schema_check`: every torch_npu call the Ascend Hal makes, run against the
real torch_npu op schemas and meta kernels, without an NPU.

Needs torch-npu importable (CANN, or the stub libraries that `.ci/make_cann_stubs.sh` builds:
`.ci/ascend_schema_check.sh` does it all). It checks
1. the recorded schemas (`hal.ascend.schemas`, which the CPU simulation binds against) equal the live ones;
2. `exercise()`, which drives every call site through the Hal's public API, on meta tensors and under
   FakeTensorMode: argument names, kinds and types bind, layouts and ranks pass the meta kernels, and
   output shapes/dtypes equal what the CPU simulation returns for the same calls;
3. the graph contract: updatable sites (and only those) have torch_npu graph handlers whose update
   keys reach the recorded call, and the torch.npu runtime functions the Hal calls exist;
4. deliberately wrong calls (misspelled keywords, a 3-D query declared BNSD, a keyword passed by
   position) are rejected, so a pass above means something.
"""
from __future__ import annotations

import inspect
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from hal.ascend.ops import CALL_SITES, AscendOps
from hal.ascend.sim.hal import SimAscendHal
from hal.attention import PagedBatch

NO_META_KERNEL = "no fake impl or Meta kernel registered"


class CheckHal(SimAscendHal):
    """The Ascend Hal's code paths with a chosen op provider on a chosen device (meta, cpu)."""

    def __init__(self, lib: Any, device: str) -> None:
        super().__init__()
        self._ops = AscendOps(lib)
        self._device = torch.device(device)

    def device(self, index: int | None = None) -> torch.device:
        return self._device


def exercise(hal: Any) -> None:
    """Every call site of `hal.ascend.ops`, reached the way the runtime reaches it."""
    device, dtype, heads, kv_heads, head_dim = hal.device(), torch.bfloat16, 8, 2, 128
    rand = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)     # noqa: E731
    mixed = PagedBatch([5, 1, 3], [5, 130, 260], [[[0], [1, 2], [3, 4, 5]], [[6], [7, 8], [9, 10, 11]]], 128)
    decode = PagedBatch([1, 1], [7, 129], [[[0], [1, 2]]], 128)
    long = PagedBatch([300], [300], [[[0, 1, 2]]], 128)       # int8: dequantized blocks (rows would read more)
    for name, batch, kv_dtype in (("fia", mixed, None), ("fia_pa", decode, None), ("fia", mixed, torch.int8),
                                  ("fia", decode, torch.int8), ("fia", long, torch.int8)):
        backend = hal.attention(heads, kv_heads, head_dim, dtype, backend=name, kv_dtype=kv_dtype)
        cache = torch.zeros(backend.kv_cache_shape(16), dtype=backend.kv_cache_dtype, device=device)
        meta = backend.build_meta(batch)
        num_tokens = sum(batch.query_lens)
        for plane in range(len(batch.block_tables)):
            k, v = rand(num_tokens, kv_heads, head_dim), rand(num_tokens, kv_heads, head_dim)
            backend.write_kv(k, v, cache, meta, plane)
            out = backend.forward(rand(num_tokens, heads, head_dim), cache, meta, plane, head_dim ** -0.5)
            assert out.shape == (num_tokens, heads, head_dim) and out.dtype == dtype, (out.shape, out.dtype)
    x, w = rand(4, 256), rand(256)
    assert hal.op("rms_norm")(x, w, 1e-6).shape == x.shape
    assert hal.op("rms_norm")(x, w, 1e-6, residual=rand(4, 256)).shape == x.shape
    for post_weight, sum_first in ((rand(256), False), (rand(256), True), (None, False)):
        y, summed = hal.op("norm_add_norm")(x, rand(4, 256), post_weight, w, 1e-6, sum_first=sum_first)
        assert y.shape == summed.shape == x.shape
    positions = torch.arange(3, device=device) + 5
    for dim, interleaved in ((128, False), (96, False), (128, True)):
        q, k = hal.op("rotary")(rand(3, heads, dim), rand(3, kv_heads, dim), positions, 1e4, interleaved)
        assert q.shape == (3, heads, dim) and k.shape == (3, kv_heads, dim)
    assert hal.op("silu_and_mul")(rand(4, 512)).shape == (4, 256)


# ----- op providers that watch the calls --------------------------------------------------------
def _signature(result: Any) -> Any:
    if isinstance(result, torch.Tensor):
        return (tuple(result.shape), str(result.dtype))
    if isinstance(result, (tuple, list)):
        return tuple(_signature(r) for r in result)
    return None


class RecordingLib:
    """Forwards to `inner`, records (op, output signature); an op without a meta kernel counts as
    schema-bound (the dispatcher matched the arguments before looking for the kernel)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, op: str) -> Callable[..., Any]:
        fn = getattr(self.inner, op)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = fn(*args, **kwargs)
            except NotImplementedError as exc:
                if NO_META_KERNEL not in str(exc):
                    raise
                self.calls.append((op, "schema-only"))
                return None
            self.calls.append((op, _signature(result)))
            return result
        return call


class MutatingLib(RecordingLib):
    """Changes the arguments of calls to one op before forwarding: a deliberately wrong call site."""

    def __init__(self, inner: Any, op: str, mutate: Callable[[tuple, dict], tuple[tuple, dict]]) -> None:
        super().__init__(inner)
        self.op, self.mutate = op, mutate

    def __getattr__(self, op: str) -> Callable[..., Any]:
        call = super().__getattr__(op)
        if op != self.op:
            return call

        def mutated(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = self.mutate(args, dict(kwargs))
            return call(*args, **kwargs)
        return mutated


def _rename(old: str, new: str) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    return lambda args, kwargs: (args, {(new if k == old else k): v for k, v in kwargs.items()})


MUTATIONS: dict[str, tuple[str, Callable[[tuple, dict], tuple[tuple, dict]]]] = {
    "fused attention: num_heads misspelled num_head": ("npu_fused_infer_attention_score",
                                                       _rename("num_heads", "num_head")),
    "fused attention: 3-D query declared BNSD": ("npu_fused_infer_attention_score",
                                                 lambda a, k: (a, {**k, "input_layout": "BNSD"})),
    "paged attention: num_kv_heads misspelled num_kv_head": ("_npu_paged_attention",
                                                             _rename("num_kv_heads", "num_kv_head")),
    "KV scatter: keyword-only cache_mode passed by position": (
        "npu_scatter_pa_kv_cache", lambda a, k: ((*a, k.pop("cache_mode")), k)),
    "rms_norm: epsilon misspelled eps": ("npu_rms_norm", _rename("epsilon", "eps")),
    "int8 attention: value_antiquant_mode misspelled value_quant_mode": (
        "npu_fused_infer_attention_score", _rename("value_antiquant_mode", "value_quant_mode")),
}


def caught_mutations(lib: Any, device: str) -> dict[str, str]:
    """Each mutation -> the first line of the error that stopped it ("" if none did)."""
    caught = {}
    for label, (op, mutate) in MUTATIONS.items():
        try:
            exercise(CheckHal(MutatingLib(lib, op, mutate), device))
            caught[label] = ""
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AssertionError) as exc:
            caught[label] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:150]
    return caught


def site_coverage(lib: Any, device: str) -> dict[str, int]:
    """Calls per call site when `exercise` runs (every site must be > 0)."""
    hal = CheckHal(lib, device)
    exercise(hal)
    return {name: hal.ops.counts[name] for name in CALL_SITES}


# ----- checks that need the real torch_npu ------------------------------------------------------
def schema_drift(torch_npu: Any) -> list[str]:
    from hal.ascend.schemas import SCHEMAS

    problems = []
    for op, recorded in SCHEMAS.items():
        namespace = torch.ops.atb if recorded.startswith("atb::") else torch.ops.npu
        live = str(getattr(namespace, op).default._schema)
        if str(torch._C.parse_schema(recorded)) != live:
            problems.append(f"{op}: recorded\n    {recorded}\n  live\n    {live}")
    return problems


def graph_contract(torch_npu: Any) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch_npu.npu._npugraph_handlers.npugraph_handler import _NPU_GRAPH_OP_HANDLERS

    problems = []
    for site in CALL_SITES.values():
        handler = _NPU_GRAPH_OP_HANDLERS.get(f"{site.op}.default")
        specs = {key for _, _, key in handler.get_update_specs(f"{site.op}.default")} if handler else set()
        if site.update_keys and not set(site.update_keys) <= specs:
            problems.append(f"{site.name}: torch_npu's graph handler updates {sorted(specs)}, "
                            f"we send {list(site.update_keys)}")
        if not site.update_keys and handler is not None:
            problems.append(f"{site.name}: NPUGraph capture records {site.op}, but the Hal sends no update")

    class Probe(TorchDispatchMode):
        """Would NPUGraph.update's assignment (kwargs by name, args by spec index) reach our keys?"""

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            handler = _NPU_GRAPH_OP_HANDLERS.get(func.__name__)
            if handler is not None:
                reachable = set(kwargs) | {key for loc, idx, key in handler.get_update_specs(func.__name__)
                                           if loc == "arg" and idx < len(args)}
                # an op several sites call (bf16 and int8 fused attention) must carry one site's keys
                sites = [s for s in CALL_SITES.values() if func.__name__ == f"{s.op}.default"]
                misses = [(s.name, set(s.update_keys) - reachable) for s in sites]
                if all(missing for _, missing in misses):
                    problems.append(f"{', '.join(n for n, _ in misses)}: update keys "
                                    f"{sorted(misses[0][1])} miss the recorded call")
            try:
                return func(*args, **kwargs)
            except NotImplementedError as exc:
                if NO_META_KERNEL in str(exc):
                    return None
                raise

    with Probe():
        exercise(CheckHal(torch_npu, "meta"))
    graph_params = inspect.signature(torch.npu.graph).parameters
    if "auto_dispatch_capture" not in graph_params:
        problems.append("torch.npu.graph has no auto_dispatch_capture")
    if "cpu_update_input" not in inspect.signature(torch.npu.NPUGraph.update).parameters:
        problems.append("NPUGraph.update takes no cpu_update_input")
    source = "".join(p.read_text() for p in Path(__file__).parent.glob("*.py") if p.name != "schema_check.py")
    for name in sorted(set(re.findall(r"(?:torch\.npu|_npu\(\)|\bnpu)\.(\w+)", source))):
        if not hasattr(torch.npu, name):
            problems.append(f"the Hal calls torch.npu.{name}, which torch_npu {torch_npu.__version__} lacks")
    return problems


def main() -> int:
    start = time.time()
    import torch_npu
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hal.ascend.sim.npu import SimNpu

    print(f"torch {torch.__version__}, torch_npu {torch_npu.__version__}")
    problems = schema_drift(torch_npu)
    real, sim = RecordingLib(torch_npu), RecordingLib(SimNpu())
    coverage = site_coverage(real, "meta")
    site_coverage(sim, "cpu")
    for name, site in CALL_SITES.items():
        kinds = sorted({str(sig) for op, sig in real.calls if op == site.op})
        print(f"  {name:24s} {site.op:34s} calls={coverage[name]}  {' | '.join(kinds)}")
        if not coverage[name]:
            problems.append(f"call site {name} was not exercised")
    for (op, real_sig), (sim_op, sim_sig) in zip(real.calls, sim.calls):
        if op != sim_op or (real_sig != "schema-only" and real_sig != sim_sig):
            problems.append(f"{op}: meta kernel gives {real_sig}, the simulation {sim_op} {sim_sig}")
    with FakeTensorMode(allow_non_fake_inputs=True):
        site_coverage(RecordingLib(torch_npu), "cpu")
    print("  FakeTensorMode: all call sites ran")
    problems += graph_contract(torch_npu)
    for label, error in caught_mutations(torch_npu, "meta").items():
        print(f"  wrong call {'caught' if error else 'NOT CAUGHT'}: {label}")
        if error:
            print(f"      -> {error}")
        if not error:
            problems.append(f"a deliberately wrong call passed: {label}")
    for p in problems:
        print("FAIL", p)
    print(f"{'FAILED' if problems else 'OK'}: {len(CALL_SITES)} call sites against torch_npu "
          f"{torch_npu.__version__} schemas and meta kernels in {time.time() - start:.1f}s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
