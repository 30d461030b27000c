"""FP8 weights for inference: `nn.Linear` swapped for per-output-channel FP8 linears.

    quantize_fp8(model, torch.float8_e4m3fn)   # bf16/fp32 linears -> FP8 + one float32 scale per row

A weight `[N, K]` is stored as FP8 `q` with `scale: [N]`, `w ~ q * scale[:, None]`, where row n's
scale is `absmax(w[n]) / FP8_MAX` (computed once, at load). The matmul goes through the Hal
(`Hal.op("fp8_linear")`: `torch._scaled_mm` on CUDA sm_89+, a Triton kernel on other GPUs); without
one (the CPU, or while a gradient is recorded) it dequantizes and multiplies in float32. A fused
matrix takes the forward context's Hal; an `Fp8Linear` (called like `nn.Linear`, without a
context) the ops it was bound to by `quantize_fp8(..., ops=...)` (the engine binds its Hal's).

Fused projections (zoo/fuse.py) keep working: a row's scale depends on that row only, so quantizing
q|k|v as one matrix equals quantizing q, k and v and concatenating, and either order gives the same
bits. The fused matrix (`GQAttention.qkv`, `SwiGLU.gate_up`) becomes an `Fp8Weight` and the parts
become `Fp8Linear`s viewing its rows, so no memory is duplicated.

Not quantized: `lm_head` (tied to the embedding in most checkpoints, and the logits are what the
sampler reads) and linears with fewer than 16 outputs (Ouro's exit gate). Inference only: the FP8
tensors are buffers, nothing here is differentiable.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from hal.common.kv_quant import dequantize, quantize
from hal.common.quantized_rows import QuantizedRows
from zoo.context import PLAIN_OPS, ModelOps

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
SKIP_NAMES = ("lm_head",)
MIN_OUT_FEATURES = 16


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, ops: ModelOps = PLAIN_OPS) -> torch.Tensor:
    """`x: [..., K]` times FP8 `weight: [N, K]` with row scales `scale: [N]` (+ `bias`), in x's dtype,
    through `ops`' fused `fp8_linear` where it has one. x may come quantized from the norm boundary before
    (`QuantizedRows`: zoo.layers.norm_add_norm with `quantized`)."""
    op = ops.op("fp8_linear")
    if op is not None:
        rows = x.flat() if isinstance(x, QuantizedRows) else x.reshape(-1, x.shape[-1])
        y = op(rows, weight, scale, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    if isinstance(x, QuantizedRows):
        x = x.dequantize()
    w = dequantize(weight, scale)                                          # [N, K] float32
    y = nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


class Fp8Weight(NamedTuple):
    """A fused FP8 matrix: callable like the linear it replaces."""

    weight: torch.Tensor            # [N, K] FP8
    scale: torch.Tensor             # [N] float32

    def __call__(self, x: torch.Tensor | QuantizedRows, ops: ModelOps = PLAIN_OPS) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, ops=ops)

    def to_format(self, dtype: torch.dtype) -> "Fp8Weight":
        return Fp8Weight(*convert_format(self.weight, self.scale, dtype))


def quantize_matrix(w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> Fp8Weight:
    """Per-output-channel FP8 of `w: [N, K]`."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"FP8 weights take {' or '.join(map(str, FP8_DTYPES))}, not {dtype}")
    return Fp8Weight(*quantize(w.detach(), dtype))


def convert_format(weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same FP8 weight in another FP8 format. e4m3fn -> e4m3fnuz (MI300) keeps every value: the
    fnuz bit pattern means half the fn value (exponent bias 8, not 7), so the bits stay and the scale
    doubles; fn's -0 (fnuz's NaN) becomes +0. Other directions dequantize and requantize."""
    if weight.dtype == dtype:
        return weight, scale
    if weight.dtype == torch.float8_e4m3fn and dtype == torch.float8_e4m3fnuz:
        bits = weight.view(torch.uint8)
        bits = torch.where(bits == 0x80, torch.zeros_like(bits), bits)
        return bits.view(dtype), scale * 2.0
    return quantize(dequantize(weight, scale), dtype)


class Fp8Linear(nn.Module):
    """Inference-only replacement of `nn.Linear`: `weight: [N, K]` FP8 and `weight_scale: [N]`
    float32 buffers (the names pre-quantized checkpoints use), and the linear's bias if it had one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float8_e4m3fn, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None
        self.ops = PLAIN_OPS                       # the Hal to multiply with (`quantize_fp8(..., ops=)`)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> "Fp8Linear":
        fp8 = quantize_matrix(linear.weight, dtype)
        return cls.of_rows(fp8, 0, linear.out_features, linear.bias)

    @classmethod
    def of_rows(cls, fp8: Fp8Weight, row: int, num_rows: int, bias: torch.Tensor | None = None) -> "Fp8Linear":
        """A linear over rows `[row, row + num_rows)` of `fp8`, viewing its storage."""
        module = cls(fp8.weight.shape[1], num_rows, bias=False, dtype=fp8.weight.dtype, device="meta")
        module.weight = fp8.weight[row:row + num_rows]
        module.weight_scale = fp8.scale[row:row + num_rows]
        if bias is not None:
            module.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return module

    def convert_(self, dtype: torch.dtype) -> None:
        self.weight, self.weight_scale = convert_format(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.ops)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.dtype}, " \
               f"bias={self.bias is not None}"


def fp8_matrix(module: Any) -> Fp8Weight | None:
    """The FP8 weight and scales the Hal's FP8 projection ops take (`silu_mul_fp8_linear`): a fused
    matrix, or a bias-free `Fp8Linear`'s; None for anything else."""
    if isinstance(module, Fp8Weight):
        return module
    if type(module) is Fp8Linear and module.bias is None:
        return Fp8Weight(module.weight, module.weight_scale)
    return None


def has_fp8_weights(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in model.modules())


def fuse_fp8(linears: list[Fp8Linear]) -> Fp8Weight:
    """Concatenate FP8 linears' rows into one matrix (their scales with them) and make each linear a
    view of its rows: `zoo.fuse` with a model loaded in FP8."""
    fused = Fp8Weight(torch.cat([lin.weight for lin in linears]), torch.cat([lin.weight_scale for lin in linears]))
    _view_rows(linears, fused)
    return fused


def _view_rows(linears: list[nn.Module], fused: Fp8Weight) -> list[Fp8Linear]:
    row, out = 0, []
    for lin in linears:
        lin_rows = lin.out_features
        out.append(Fp8Linear.of_rows(fused, row, lin_rows, lin.bias))
        row += lin_rows
    for lin, view in zip(linears, out):
        if isinstance(lin, Fp8Linear):            # in place: the parent keeps its module
            lin.weight, lin.weight_scale = view.weight, view.weight_scale
    return out


def _quantizable(name: str, linear: nn.Linear) -> bool:
    return name not in SKIP_NAMES and linear.out_features >= MIN_OUT_FEATURES


@torch.no_grad()
def quantize_fp8(model: nn.Module, dtype: torch.dtype = torch.float8_e4m3fn, ops: ModelOps | None = None) -> int:
    """Swap the model's linears for `Fp8Linear`s in `dtype` (fused matrices first, quantized as one);
    FP8 linears already there are converted to `dtype`; every FP8 linear multiplies through `ops`
    (default plain torch). In place; returns how many linears or fused matrices are FP8 now."""
    from zoo.fuse import FUSED_PROJECTIONS

    if dtype not in FP8_DTYPES:
        raise ValueError(f"FP8 weights take {' or '.join(map(str, FP8_DTYPES))}, not {dtype}")
    count, done = 0, set()
    for module in model.modules():
        for cls, attr, part_names in FUSED_PROJECTIONS:
            fused = getattr(module, attr, None) if isinstance(module, cls) else None
            if fused is None:
                continue
            fp8 = fused.to_format(dtype) if isinstance(fused, Fp8Weight) else quantize_matrix(fused, dtype)
            setattr(module, attr, fp8)
            parts = [getattr(module, name) for name in part_names]
            for name, view in zip(part_names, _view_rows(parts, fp8)):
                setattr(module, name, view)
                done.add(id(view))
            count += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in done:
                continue
            if isinstance(child, Fp8Linear):
                child.convert_(dtype)
                count += 1
            elif isinstance(child, nn.Linear) and _quantizable(name, child):
                setattr(parent, name, Fp8Linear.from_linear(child, dtype))
                count += 1
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.ops = ops or PLAIN_OPS
    return count


def fp8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP8 linears' tensors as a compressed-tensors checkpoint stores them: `<name>.weight` e4m3fn
    `[N, K]` and `<name>.weight_scale` float32 `[N, 1]` (fnuz weights converted to fn)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            weight, scale = convert_format(module.weight, module.weight_scale, torch.float8_e4m3fn)
            out[f"{name}.weight"] = weight.contiguous()
            out[f"{name}.weight_scale"] = scale.float().reshape(-1, 1).contiguous()
    return out


def compressed_tensors_config(model: nn.Module) -> dict[str, Any]:
    """`quantization_config` of config.json for `fp8_state`'s layout: per-channel FP8 weights, no
    static activation scales, the linears left in high precision listed under `ignore`."""
    kept = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": kept}
