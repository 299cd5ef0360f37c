"""fp8 (e4m3) weights: per-output-channel quantization at load, fp8 checkpoints brought to that form, and
the linear that runs them through torch._scaled_mm with dynamic per-token activation scales.

fp8 is a GPU method. torch 2.13's _scaled_mm does run on CPU, but as a slow fallback: measured on the
2-core dev CPU, x[1, 576] @ w[1536, 576].T took ~35-43 ms against ~0.1-0.4 ms in float32 (and x[64, 576]
~125-133 ms against ~12-32 ms), so check_fp8_device refuses CPU at load; CPU runs use int8 instead.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max            # 448
# Smallest scale: keeps an all-zero row or token from dividing by zero (its codes are then all 0).
_MIN_SCALE = 1e-12


@dataclass
class Fp8Weight:
    """A linear weight in e4m3 with one float32 scale per output row: what fp8_linear takes."""
    w: torch.Tensor                  # float8_e4m3fn [out, in], row-major
    scale: torch.Tensor              # float32 [out]

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size() + self.scale.numel() * self.scale.element_size()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, self.w, self.scale, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.w, self.scale, dtype)


def pack_fp8(w: torch.Tensor) -> Fp8Weight:
    """A float weight [out, in], on the device it will run on, quantized per output channel at load."""
    check_fp8_device(w.device)
    check_fp8_shape(*w.shape)
    return Fp8Weight(*quantize_fp8(w))


def check_fp8_device(device: str | torch.device) -> None:
    """Raise ValueError unless `device` runs fp8 GEMMs natively (CUDA, compute capability 8.9+)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"quantization 'fp8' needs a CUDA GPU with fp8 tensor cores (Ada/Hopper), not "
                         f"{device.type}: torch._scaled_mm on CPU is a slow fallback; use 'int8' on CPU")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"quantization 'fp8' needs compute capability 8.9+ (Ada/Hopper), this GPU is "
                         f"{capability[0]}.{capability[1]}")


def check_fp8_shape(out_features: int, in_features: int) -> None:
    # cuBLASLt / CUTLASS fp8 GEMMs need K and N to be multiples of 16 (mat2 must be 16-aligned both ways).
    if out_features % 16 or in_features % 16:
        raise ValueError(f"fp8 needs linear sizes divisible by 16, got out_features {out_features}, "
                         f"in_features {in_features}")


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Clamp first: a value that rounds past 448 would become NaN in e4m3fn, which has no infinity.
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], float32 scale [out]) with w ~= w_fp8 * scale[:, None]."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a 2-D weight, got shape {tuple(w.shape)}")
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return _to_fp8(w32, scale.unsqueeze(1)), scale


def dequantize_fp8(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight of (w_fp8 [out, in], scale [out] per row, or a scalar per tensor)."""
    scale = scale.float()
    return (w_fp8.float() * (scale.unsqueeze(1) if scale.dim() == 1 else scale)).to(dtype)


def dequantize_fp8_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor,
                              block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """The float32 weight an fp8 checkpoint's e4m3 `weight` and its scale mean, exactly.

    Per-tensor files: `weight_scale`, a scalar (or one per row). Block files (weight_block_size [bo, bi]):
    `weight_scale_inv` [ceil(out/bo), ceil(in/bi)], one per block; despite its name it multiplies.
    """
    out, cols = weight.shape
    if block_size is None:
        if weight_scale.numel() not in (1, out):
            raise ValueError(f"fp8 weight_scale has {weight_scale.numel()} values for a weight of {out} rows: "
                             f"expected 1 (per tensor) or {out} (per channel)")
        return dequantize_fp8(weight, weight_scale.float().reshape(-1).expand(out))
    bo, bi = block_size
    expected = (-(-out // bo), -(-cols // bi))
    if tuple(weight_scale.shape) != expected:
        raise ValueError(f"fp8 weight_scale_inv has shape {tuple(weight_scale.shape)}, expected {expected} "
                         f"for weight {out}x{cols} in blocks of {bo}x{bi}")
    scale = weight_scale.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]
    return weight.float() * scale


def fp8_checkpoint_to_channel(weight: torch.Tensor, weight_scale: torch.Tensor,
                              block_size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 checkpoint's weight in the per-channel form fp8_linear takes. Per-tensor files keep their
    codes (the scale is only expanded); block files are requantized per row: one more e4m3 rounding."""
    w = dequantize_fp8_checkpoint(weight, weight_scale, block_size)     # validates the scale's shape
    if block_size is None:
        return weight.to(FP8_DTYPE), weight_scale.float().reshape(-1).expand(weight.shape[0]).contiguous()
    return quantize_fp8(w)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (float8_e4m3fn [m, k], float32 scale [m, 1]): one scale per token, from its amax."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return _to_fp8(x.float(), scale), scale


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ (w_fp8 [out, in] * w_scale [out]).T + bias, in x's dtype.

    Activations are quantized per token on the fly (or with a checkpoint's static `input_scale`, a scalar).
    w_fp8 must be row-major [out, in]: its .t() is then the column-major [in, out] operand _scaled_mm needs.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if input_scale is None:
        x_fp8, x_scale = quantize_fp8_per_token(x2)
    else:
        # Row-wise _scaled_mm takes both scales row-wise: the static scalar is spread over the tokens.
        x_scale = input_scale.float().reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        x_fp8 = _to_fp8(x2.float(), x_scale)
    # CUDA's row-wise scaled GEMM writes bf16 only; the CPU fallback writes any float dtype.
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.float().reshape(1, -1),
                         out_dtype=out_dtype).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], w_fp8.shape[0])


# Per-tensor files name the weight's scale weight_scale, block files weight_scale_inv (both multiply).
_SCALE_NAMES = ("weight_scale", "weight_scale_inv")
# Activation and KV-cache scales of static-scheme files: activations are scaled per token on the fly
# instead (at least as accurate as one calibrated scalar), and the KV cache keeps its own dtype setting.
_DROPPED = ("input_scale", "k_scale", "v_scale", "kv_scale")


def combine_fp8_checkpoint(weights: Iterator[tuple[str, torch.Tensor]],
                           block_size: tuple[int, int] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """An fp8 checkpoint's stream with each e4m3 weight and its scale (any order) replaced by the float32
    weight they mean, for the layers to pack per channel at load; float tensors pass through."""
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _DROPPED:
            continue
        if leaf in _SCALE_NAMES:
            if (block_size is None) != (leaf == "weight_scale"):
                raise ValueError(f"{name}: an fp8 checkpoint with weight_block_size {block_size} names its "
                                 f"scales {'weight_scale_inv' if block_size else 'weight_scale'}")
            scales[prefix] = tensor
        elif leaf == "weight" and tensor.dtype == FP8_DTYPE:
            codes[prefix] = tensor
        else:
            yield name, tensor
            continue
        if prefix in codes and prefix in scales:
            yield prefix + ".weight", dequantize_fp8_checkpoint(codes.pop(prefix), scales.pop(prefix), block_size)
    if codes or scales:
        missing = sorted([f"{p}.weight_scale{'_inv' if block_size else ''}" for p in codes] +
                         [f"{p}.weight" for p in scales])
        raise ValueError(f"fp8 checkpoint lacks {', '.join(missing[:10])}")
