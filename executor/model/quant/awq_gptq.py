"""AWQ (AutoAWQ GEMM) and GPTQ checkpoint tensors decoded to GroupQuantWeight, and the weight stream that
gathers each linear's packed parts (qweight, qzeros, scales, g_idx) into one weight.

AWQ GEMM, for a linear of in_features x out_features in groups of g input columns:
    qweight int32 [in, out/8]: word c holds columns 8c..8c+7, column 8c+(0,2,4,6,1,3,5,7)[k] in bits 4k..
    qzeros  int32 [in/g, out/8]: the same packing          scales fp16 [in/g, out]
GPTQ (AutoGPTQ / GPTQModel), b bits, p = 32 // b codes per word, packed in plain order:
    qweight int32 [in/p, out]: word r holds input rows p*r .. p*r+p-1, row p*r+k in bits b*k..
    qzeros  int32 [groups, out/p]: packed along out, same order   scales fp16 [groups, out]   g_idx int32 [in]
    format "gptq" (v1) stores zero - 1, "gptq_v2" stores the zero. Input row i is in group g_idx[i]: i // g
    normally; with act-order (desc_act) a permutation of that, group_size rows per group.
Both decode as w[o, i] = scale * (q - zero), i.e. offset = -scale * zero.
"""
from __future__ import annotations

from collections.abc import Iterator
import torch

from pagedserve.common.quantization import QuantSpec
from pagedserve.executor.model.quant.fp8 import combine_fp8_checkpoint
from pagedserve.executor.model.quant.group_quant import GroupQuantWeight

# AutoAWQ's packer puts column (0, 2, 4, 6, 1, 3, 5, 7)[k] of each 8 in nibble k; so column j sits in
# nibble AWQ_REVERSE_ORDER[j].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

Weights = Iterator[tuple[str, torch.Tensor]]


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] -> uint8 [r, c * 32/bits]: the codes of each word, lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")


def _group_size(group_size: int, in_features: int, what: str) -> int:
    g = in_features if group_size == -1 else group_size
    if g <= 0 or in_features % g:
        raise ValueError(f"{what} group_size {group_size} does not divide in_features {in_features}")
    return g


def awq_to_group_quant(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int) -> GroupQuantWeight:
    """An AutoAWQ GEMM 4-bit linear as GroupQuantWeight [out, in]."""
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    g = _group_size(group_size, in_features, "awq")
    groups = in_features // g
    _check_shape("awq qzeros", qzeros, (groups, out_features // 8))
    _check_shape("awq scales", scales, (groups, out_features))
    reverse = torch.tensor(AWQ_REVERSE_ORDER, device=qweight.device)
    order = (torch.arange(0, out_features, 8, device=qweight.device).unsqueeze(1) + reverse).reshape(-1)
    q = _unpack_cols(qweight, 4)[:, order]                 # [in, out], columns in natural order
    zeros = _unpack_cols(qzeros, 4)[:, order].float()      # [groups, out]
    scale = scales.float()
    return GroupQuantWeight(q.t().contiguous(), scale.t().contiguous(), (-scale * zeros).t().contiguous(), 4, g)


def gptq_to_group_quant(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                        g_idx: torch.Tensor | None, bits: int, group_size: int,
                        checkpoint_format: str = "gptq") -> GroupQuantWeight:
    """A GPTQ linear (4 or 8 bits) as GroupQuantWeight [out, in].

    Act-order checkpoints (desc_act, a g_idx other than i // group_size) come out with their columns sorted
    by group, so each group is a run of adjacent columns as the kernels need, and the sorting as `perm`.
    """
    if bits not in (4, 8):
        raise ValueError(f"gptq bits must be 4 or 8, got {bits}")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    pack = 32 // bits
    in_features, out_features = qweight.shape[0] * pack, qweight.shape[1]
    g = _group_size(group_size, in_features, "gptq")
    groups = in_features // g
    _check_shape("gptq qzeros", qzeros, (groups, out_features // pack))
    _check_shape("gptq scales", scales, (groups, out_features))
    perm = None if g_idx is None else act_order_perm(g_idx, in_features, g)
    # qweight packs along `in`: unpack each column of words, i.e. unpack the transpose.
    q = _unpack_cols(qweight.t(), bits)                    # [out, in]
    if perm is not None:
        q = q[:, perm]
    zeros = _unpack_cols(qzeros, bits).float()             # [groups, out]
    if checkpoint_format == "gptq":
        # v1 stores zero - 1; add it back without masking, as vLLM's and exllama's kernels do.
        zeros = zeros + 1
    scale = scales.float()
    return GroupQuantWeight(q.contiguous(), scale.t().contiguous(), (-scale * zeros).t().contiguous(), bits, g,
                            perm)


def act_order_perm(g_idx: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor | None:
    """The column order that sorts g_idx (None where it is already i // group_size), after checking that
    every group has exactly group_size columns, as GPTQ's act-order writes them."""
    if tuple(g_idx.shape) != (in_features,):
        raise ValueError(f"gptq g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
    g_idx = g_idx.to(torch.int64)
    groups = in_features // group_size
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"gptq g_idx has a group outside 0..{groups - 1}")
    counts = torch.bincount(g_idx, minlength=groups)
    if not bool((counts == group_size).all()):
        bad = int((counts != group_size).nonzero()[0])
        raise ValueError(f"gptq g_idx puts {int(counts[bad])} columns in group {bad}, expected group_size "
                         f"{group_size} in every group")
    perm = torch.sort(g_idx, stable=True).indices
    if torch.equal(perm, torch.arange(in_features, device=perm.device)):
        return None
    return perm


def check_trivial_g_idx(g_idx: torch.Tensor, in_features: int, group_size: int) -> None:
    """A g_idx that arrives after its weight was decoded without it must not have been needed."""
    if act_order_perm(g_idx, in_features, group_size) is not None:
        raise ValueError("gptq g_idx permutes the groups (act-order) but quantization_config has desc_act "
                         "false, and the weight was already decoded without it: set desc_act true")


_AWQ_PARTS = ("qweight", "qzeros", "scales")
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def combine_quantized_tensors(weights: Weights,
                              spec: QuantSpec | None) -> Iterator[tuple[str, torch.Tensor | GroupQuantWeight]]:
    """The HF weight stream with each AWQ/GPTQ linear's packed tensors replaced by one
    (prefix + ".weight", GroupQuantWeight), yielded once all its parts have arrived (any order, any shard).
    Every other tensor passes through unchanged, as does the whole stream for other methods, except fp8
    checkpoints: their e4m3 weights come out as the float32 weights they mean (see fp8.py)."""
    if spec is not None and spec.method == "fp8":
        yield from combine_fp8_checkpoint(weights, spec.weight_block_size)
        return
    if spec is None or spec.method not in ("awq", "gptq"):
        yield from weights
        return
    parts = _AWQ_PARTS if spec.method == "awq" else _GPTQ_PARTS
    # g_idx is optional without act-order (older GPTQ files lack it); one arriving late is still checked.
    needed = set(parts) - ({"g_idx"} if spec.method == "gptq" and not spec.desc_act else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: dict[str, tuple[int, int]] = {}                 # prefix -> (in_features, group size)
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in parts or not prefix:
            yield name, tensor
            continue
        if part == "g_idx" and prefix in done:
            check_trivial_g_idx(tensor, *done[prefix])
            continue
        if prefix in done or part in pending.get(prefix, {}):
            raise ValueError(f"checkpoint has {name} twice")
        have = pending.setdefault(prefix, {})
        have[part] = tensor
        if needed <= have.keys():
            try:
                weight = _decode(pending.pop(prefix), spec)
            except ValueError as exc:         # the parts' names: the decoder knows only their roles
                raise ValueError(f"{prefix}.{{{','.join(parts)}}}: {exc}") from exc
            done[prefix] = (weight.shape[1], weight.group_size)
            yield prefix + ".weight", weight
    if pending:
        missing = [f"{p}.{part}" for p, have in sorted(pending.items()) for part in sorted(needed - have.keys())]
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(f"{spec.method} checkpoint lacks {', '.join(missing[:10])}{more}")


def _decode(parts: dict[str, torch.Tensor], spec: QuantSpec) -> GroupQuantWeight:
    if spec.method == "awq":
        return awq_to_group_quant(parts["qweight"], parts["qzeros"], parts["scales"], spec.group_size)
    return gptq_to_group_quant(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                               spec.bits, spec.group_size, spec.checkpoint_format)
