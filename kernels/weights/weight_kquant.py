"""The K form of an int4 weight's group scales: a GGUF K-quant's two levels kept at the file's size.

Q4_K stores 256 weights as 8 groups of 32 whose scale and min are 6-bit codes under a float16 (d, dmin) pair:
w = d * sc * q - dmin * m. Widened to a bfloat16 (scale, zero) pair per group, as the other int4 forms hold
them, its scales take 1 bit a weight (5 in all against the file's 4.5): on the 1.7B Q4_K_M model ~150 MB of
the ~1.2 GB a decode token reads. The K form keeps the file's structure in byte-aligned pieces the kernels load
with one shift or mask (kernels/cpu/csrc/gemv.h, SZ_K): per group and output channel a 16-bit word (scale code | zero
code << 8), per 8 groups and channel float16 (d, o), scale = d * scale code, offset = o * zero code. 4.625 bits a
weight, and exact: every (scale, offset) is the file's, where the bfloat16 pair rounded each scale to 8 bits.

Nothing here knows GGUF: any group scales that factor exactly into 8-bit codes under a float16 base per 8 groups
take the form (`k_form_scales` checks every one), others keep the pairs. The loader asks only for weights
decoded from K-quants (GroupQuantWeight.k_quant): up to 63 passes over other scales would only slow loading.
"""
from __future__ import annotations

import torch

from pagedserve.kernels.cpu.native import SZ_K_GROUPS

# The largest code a K-quant's sub-scales use (6 bits). llama.cpp's reference quantizer gives the block's
# largest scale this code; its importance-matrix quantizer may not, so blocks that do not factor try the
# smaller codes after it (their largest scale is d times one of them, exactly).
_K_TOP_CODE = 63


def _codes(values: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., 8] as round(values / base) and whether each block of 8 is exactly base * its codes in
    0..255 with a base that float16 holds."""
    safe = torch.where(base == 0, torch.ones_like(base), base)
    codes = torch.round(values / safe.unsqueeze(-1))
    exact = (codes >= 0) & (codes <= 255) & (base.unsqueeze(-1) * codes == values)
    return codes, exact.all(-1) & (base.half().float() == base)


def _factor(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """values [out, blocks, 8] float32 as a float16-exact base [out, blocks] times uint8 codes, or None."""
    top, bottom = values.amax(-1), values.amin(-1)
    extreme = torch.where(top.abs() >= bottom.abs(), top, bottom)     # the code-63 value, with its sign
    base = extreme / _K_TOP_CODE
    codes, exact = _codes(values, base)
    for top_code in range(_K_TOP_CODE - 1, 0, -1):
        if bool(exact.all()):
            break
        miss = ~exact
        retry = extreme[miss] / top_code
        again, fits = _codes(values[miss], retry)
        base[miss] = torch.where(fits, retry, base[miss])
        codes[miss] = torch.where(fits.unsqueeze(-1), again, codes[miss])
        exact[miss] = fits
    if not bool(exact.all()):
        return None
    return base, codes.to(torch.uint8)


def _as_int16(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 16-bit values (int32) as the int16 of the same bits."""
    return (words - ((words >> 15) << 16)).to(torch.int16)


def k_form_scales(scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor | None:
    """w = scale * q + offset (float [out, groups]) in the K form: int16 [groups + groups // 4, out], the words
    and then the super-scales (kernels/cpu/csrc/gemv.h); None where the groups do not factor exactly."""
    out, groups = scale.shape
    if groups % SZ_K_GROUPS or tuple(offset.shape) != (out, groups):
        return None
    blocks = (out, groups // SZ_K_GROUPS, SZ_K_GROUPS)
    scales = _factor(scale.float().reshape(blocks))
    offsets = _factor(offset.float().reshape(blocks)) if scales is not None else None
    if offsets is None:
        return None
    (d, sc), (o, m) = scales, offsets
    words = (sc.to(torch.int32) | (m.to(torch.int32) << 8)).reshape(out, groups).t()          # [groups, out]
    supers = torch.stack((d.t(), o.t()), 1).half().view(torch.int16).reshape(-1, out)  # [groups / 8 * 2, out]
    return torch.cat((_as_int16(words), supers), 0).contiguous()


def k_form_scale_offset(sz: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K form's (scale, offset) per group, float32 [groups, out]: for paths outside our kernels."""
    words = sz[:groups].to(torch.int32) & 0xFFFF
    supers = sz[groups:].view(torch.float16).float().reshape(groups // SZ_K_GROUPS, 2, -1)
    d, o = (supers[:, i].repeat_interleave(SZ_K_GROUPS, 0) for i in (0, 1))
    return d * (words & 0xFF).float(), o * (words >> 8).float()
