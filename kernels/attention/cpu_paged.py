"""Paged attention and the cache write of the CPU backend, reading the cache blocks in place.

Cache layout: [num_blocks, num_kv_heads, block_size, head_dim] per K and V. Viewed as rows of
[num_blocks * num_kv_heads, block_size * head_dim], one row is one KV head's whole block, so a single
index_select over row ids (head-major) lands every head's context of a group of sequences straight in
the [kv_heads, seqs, len, head_dim] layout attention wants. When K and V are the two halves of one
[2, ...] tensor (as the model runner allocates them), one index_select reads both.

Everything that depends only on the batch, not on the layer (row ids, write positions, masks), is built
once per forward pass in a StepPlan and reused by every layer: at batch 1 the per-layer work is then one
index_put_ per cache, one index_select and one SDPA call.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.common.config.dtype import cpu_has_native_bf16
from pagedserve.kernels.cpu.native import check, library, threads_for
from pagedserve.kernels.weights.weight_only import INT4_INT8_MIN_ROWS
from pagedserve.kernels.attention.metadata import AttentionMetadata

DECODE_GROUP = 16
# Query rows of a prompt chunk from which it attends in bfloat16 over a bfloat16 cache (_prefill_dtype): the
# rows from which the int4 linears round their inputs.
PREFILL_BF16_MIN_ROWS = INT4_INT8_MIN_ROWS


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes lo..hi-1, attended together over contexts padded to `length`."""
    lo: int
    hi: int
    length: int
    rows: torch.Tensor               # [Hkv * S * nblocks] row ids, K rows then (if stacked) V rows
    mask: torch.Tensor | None        # [S, 1, 1, length] bool; None when every member has `length` tokens


@dataclass(frozen=True)
class PrefillSeq:
    """Query tokens lo..hi-1 of one sequence of `length` tokens (the new ones last)."""
    lo: int
    hi: int
    length: int
    rows: torch.Tensor
    mask: torch.Tensor | None        # [q, length] bool when earlier tokens are cached or rows see past
                                     # themselves (meta.visible_until), else None
    causal: bool                     # the whole sequence at once (q == length > 1): SDPA's own causal mask


@dataclass(frozen=True)
class StepPlan:
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSeq, ...]


@dataclass(frozen=True)
class WritePlan:
    rows: torch.Tensor               # [T', Hkv] rows of the cache viewed [num_blocks * Hkv * block_size, D]
    tokens: torch.Tensor | None      # the tokens with a slot (>= 0); None when all have one


class LastStep:
    """What was derived from the last step's inputs, keyed by the input object itself: every layer
    gets the same metadata and slot tensors, and the runner makes new ones each step. A weak reference
    (a dead object is never mistaken for a new one at its address) plus the tensors' version counters
    (an in-place change invalidates)."""

    def __init__(self) -> None:
        self._owner: weakref.ref | None = None
        self._versions: tuple[int, ...] = ()
        self._made: dict[tuple, object] = {}

    def get(self, owner: object, versions: tuple[int, ...], key: tuple, build: Callable) -> object:
        if self._owner is None or self._owner() is not owner or self._versions != versions:
            self._owner, self._versions, self._made = weakref.ref(owner), versions, {}
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = build(owner, *key)
        return made


def version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter; inference tensors keep none (-1): under inference_mode the
    runner's step inputs are new tensors every step, which the identity check already catches."""
    return -1 if t.is_inference() else t._version


_step_plans = LastStep()
_write_plans = LastStep()
_token_plans = LastStep()


def stacked_rows(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """[2 * num_blocks * Hkv, block_size * D] rows over K then V when they are adjacent halves of one
    tensor (the runner's [2, ...] cache), else None."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.dtype == v_cache.dtype):
        return None
    if k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr():
        return None
    if v_cache.storage_offset() != k_cache.storage_offset() + k_cache.numel():
        return None
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    return k_cache.as_strided((2 * num_blocks * num_kv_heads, block_size * head_dim), (block_size * head_dim, 1))


def step_plan(meta: AttentionMetadata, k_cache: torch.Tensor, stacked: bool, decodes: bool = True) -> StepPlan:
    """decodes=False: the decodes are attended elsewhere (decode_native), so no groups are built for them."""
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    versions = (id(meta.block_tables), version(meta.block_tables), id(meta.seq_lens), version(meta.seq_lens))
    key = (num_blocks, num_kv_heads, block_size, stacked, k_cache.device, decodes)
    return _step_plans.get(meta, versions, key, _build_plan)


def write_plan(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> WritePlan:
    key = (k_cache.shape[1], k_cache.shape[2])
    return _write_plans.get(slot_mapping, (version(slot_mapping),), key, _build_write_plan)


def _build_write_plan(slots: torch.Tensor, num_kv_heads: int, block_size: int) -> WritePlan:
    valid = slots >= 0
    tokens = None
    if not bool(valid.all()):       # once per step, not once per layer
        tokens = valid.nonzero().flatten()
        slots = slots[tokens]
    heads = torch.arange(num_kv_heads, device=slots.device)
    rows = ((slots // block_size) * num_kv_heads)[:, None] + heads
    return WritePlan(rows * block_size + (slots % block_size)[:, None], tokens)


def _build_plan(meta: AttentionMetadata, num_blocks: int, num_kv_heads: int, block_size: int, stacked: bool,
                device: torch.device, with_decodes: bool) -> StepPlan:
    heads = torch.arange(num_kv_heads, device=device)

    def rows(tables: torch.Tensor, length: int) -> torch.Tensor:
        nblocks = -(-length // block_size)
        ids = tables[:, :nblocks].reshape(-1).to(torch.int64) * num_kv_heads
        out = (heads[:, None] + ids[None, :]).reshape(-1)
        return torch.cat((out, out + num_blocks * num_kv_heads)) if stacked else out

    decodes = []
    lens = meta.seq_lens_cpu
    # Decodes of several tokens (a draft being verified) are planned as chunks with cached context: their
    # masks are causal inside the new tokens, which the one-token decode groups have no need of.
    first_chunk = meta.num_decodes if meta.decode_query_len == 1 else 0
    for lo in range(0, first_chunk if with_decodes else 0, DECODE_GROUP):
        hi = min(lo + DECODE_GROUP, first_chunk)
        length = max(lens[lo:hi])
        mask = None
        if min(lens[lo:hi]) != length:
            mask = torch.arange(length, device=device)[None, :] < meta.seq_lens[lo:hi, None]
            mask = mask[:, None, None, :]
        decodes.append(DecodeGroup(lo, hi, length, rows(meta.block_tables[lo:hi], length), mask))
    prefills = []
    starts = meta.query_start_loc_cpu
    for i in range(first_chunk, meta.num_seqs):
        lo, hi, length = starts[i], starts[i + 1], lens[i]
        if hi == lo:
            continue
        mask = None
        if 1 < hi - lo < length:
            # Query row r sits at absolute position length - q + r and sees keys up to it.
            q_pos = torch.arange(length - (hi - lo), length, device=device)
            mask = torch.arange(length, device=device)[None, :] <= q_pos[:, None]
        causal = 1 < hi - lo == length
        if meta.visible_until is not None and hi - lo > 1:      # rows that may see past themselves (item_bounds.py)
            until = meta.visible_until[lo:hi]
            if bool((until >= length - (hi - lo) + torch.arange(1, hi - lo + 1, device=device)).any()):
                mask, causal = torch.arange(length, device=device)[None, :] <= until[:, None], False
        prefills.append(PrefillSeq(lo, hi, length, rows(meta.block_tables[i:i + 1], length), mask, causal))
    return StepPlan(tuple(decodes), tuple(prefills))


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: WritePlan) -> None:
    """key/value [T, Hkv, D] into the caches at the plan's rows (tokens without a slot skipped)."""
    if plan.tokens is not None:
        key, value = key[plan.tokens], value[plan.tokens]
    head_dim = k_cache.shape[-1]
    # index_put_ with one index tensor [T, Hkv] takes key as it is (no reshape copy of a strided slice).
    k_cache.view(-1, head_dim).index_put_((plan.rows,), key.to(k_cache.dtype))
    v_cache.view(-1, head_dim).index_put_((plan.rows,), value.to(v_cache.dtype))


def gather(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_rows: torch.Tensor | None, rows: torch.Tensor,
           seqs: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [Hkv, seqs, length, D] (views of one or two fresh buffers)."""
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    nblocks = -(-length // block_size)
    shape = (num_kv_heads, seqs, nblocks * block_size, head_dim)
    if kv_rows is not None:
        both = kv_rows.index_select(0, rows).view(2, *shape)[..., :length, :]
        return both[0], both[1]
    half = rows.shape[0]
    keys = k_cache.view(-1, block_size * head_dim).index_select(0, rows[:half]).view(shape)
    values = v_cache.view(-1, block_size * head_dim).index_select(0, rows[:half]).view(shape)
    return keys[..., :length, :], values[..., :length, :]


# Limits of the C decode kernel (kernels/cpu/csrc/decode_attention.c keeps its per-task state on the stack).
_NATIVE_MAX_GROUP, _NATIVE_MAX_HEAD_DIM, _NATIVE_MAX_BLOCK = 16, 256, 128
# Cached rows (tokens x KV heads) per thread below which a second thread does not pay (measured: a
# 200-token batch-1 decode took 0.066 ms on one thread, 0.10 on two).
_NATIVE_MIN_ROWS_PER_THREAD = 2048


def _native_takes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tables: torch.Tensor, lens: torch.Tensor) -> bool:
    """Whether the C kernel takes these queries over this cache (and the library is built)."""
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    num_heads = query.shape[1]
    return not (query.device.type != "cpu" or k_cache.dtype not in (torch.float32, torch.bfloat16)
                or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous())
                or num_heads % num_kv_heads or num_heads // num_kv_heads > _NATIVE_MAX_GROUP
                or head_dim > _NATIVE_MAX_HEAD_DIM or block_size > _NATIVE_MAX_BLOCK
                or tables.dtype != torch.int32 or lens.dtype != torch.int32 or tables.stride(-1) != 1
                or library() is None)


def _native(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor, cached_rows: int, scale: float) -> torch.Tensor:
    """ps_paged_decode: query token t [Hq, D] over the first lens[t] keys of block table tables[t]."""
    n, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    q = query.to(torch.float32).contiguous()
    out = torch.empty(n, num_heads, head_dim, dtype=torch.float32)
    bf16 = int(k_cache.dtype == torch.bfloat16)
    check(library().ps_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bf16, tables.data_ptr(),
                                    tables.stride(0), lens.data_ptr(), out.data_ptr(), n, num_heads, num_kv_heads,
                                    block_size, head_dim, scale,
                                    threads_for(cached_rows * num_kv_heads, _NATIVE_MIN_ROWS_PER_THREAD)),
          "paged decode")
    return out.to(query.dtype)


@dataclass(frozen=True)
class TokenPlan:
    """Each query token of a step as a decode of its own: its sequence's block table and its position + 1."""
    tables: torch.Tensor             # [T, max_blocks] int32
    lens: torch.Tensor               # [T] int32
    cached_rows: int                 # sum of lens: the key rows read


def _build_token_plan(meta: AttentionMetadata) -> TokenPlan:
    starts = meta.query_start_loc_cpu
    counts = torch.tensor([starts[i + 1] - starts[i] for i in range(meta.num_seqs)], dtype=torch.int64)
    seq_of = torch.repeat_interleave(torch.arange(meta.num_seqs), counts)
    ends = torch.tensor(starts[1:], dtype=torch.int64)[seq_of]
    # Token t of sequence i sits (ends - 1 - t) tokens before that sequence's last and sees keys up to itself.
    lens = (meta.seq_lens.to(torch.int64)[seq_of] - (ends - 1 - torch.arange(starts[-1]))).to(torch.int32)
    tables = meta.block_tables.index_select(0, seq_of).contiguous()
    return TokenPlan(tables, lens.contiguous(), int(lens.sum()))


def row_native(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor | None:
    """Every query token of the step attended alone by the C decode kernel, over the keys of its own position
    in the cache, block by block in order with an online softmax: [T, Hq, D]. A token's bits then never depend
    on the other tokens of its step: a prompt's row is the same fresh, after a prefix-cache hit, in any
    chunk and beside any batch (docs/determinism.md); SDPA's flash kernel blocks the queries and keys by the
    chunk's size and takes a mask or its own causal form by where the prompt was cut. None where the kernel
    does not apply (tokens that see past themselves: meta.visible_until; shapes past its limits)."""
    if meta.visible_until is not None or query.shape[0] == 0 or query.shape[0] != meta.query_start_loc_cpu[-1]:
        return None
    if not _native_takes(query, k_cache, v_cache, meta.block_tables, meta.seq_lens):
        return None
    versions = (id(meta.block_tables), version(meta.block_tables), id(meta.seq_lens), version(meta.seq_lens))
    plan = _token_plans.get(meta, versions, (), _build_token_plan)
    return _native(query, k_cache, v_cache, plan.tables, plan.lens, plan.cached_rows, scale)


def decode_native(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor | None:
    """Attention of the step's decodes (its first meta.num_decodes tokens) through the C kernel, which reads
    the blocks in place: [num_decodes, Hq, D]; None where the kernel does not apply (no compiler, another
    device or cache dtype, shapes past its limits, decodes of several tokens), and the PyTorch path below
    serves them."""
    n = meta.num_decodes
    tables, lens = meta.block_tables[:n], meta.seq_lens[:n]
    if n == 0 or meta.decode_query_len != 1 or not _native_takes(query, k_cache, v_cache, tables, lens):
        return None
    return _native(query[:n], k_cache, v_cache, tables, lens.contiguous(), sum(meta.seq_lens_cpu[:n]), scale)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float, per_token: bool = False) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over a float cache read in place: the step's decodes through the
    C kernel where it applies, the rest through SDPA on the step's shared plan; per_token: every token through
    the C kernel where it applies (row_native)."""
    rows = row_native(query, k_cache, v_cache, meta, scale) if per_token else None
    if rows is not None:
        return rows
    kv_rows = stacked_rows(k_cache, v_cache)
    decoded = decode_native(query, k_cache, v_cache, meta, scale)
    plan = step_plan(meta, k_cache, kv_rows is not None, decodes=decoded is None)
    return paged_attention(query, k_cache, v_cache, kv_rows, plan, scale, decoded)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    kv_rows: torch.Tensor | None, plan: StepPlan, scale: float,
                    decoded: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each sequence's paged context; returns [T, Hq, D].
    decoded: the decodes' attention already computed (decode_native; the plan then has no decode groups)."""
    if decoded is not None and decoded.shape[0] == query.shape[0]:
        return decoded
    # One group or one prefill covering the whole step (batch-1 decode, a lone prompt): no copy out.
    if len(plan.decodes) == 1 and not plan.prefills and plan.decodes[0].hi == query.shape[0]:
        return _decode(query, k_cache, v_cache, kv_rows, plan.decodes[0], scale)
    if len(plan.prefills) == 1 and not plan.decodes and plan.prefills[0].hi - plan.prefills[0].lo == query.shape[0]:
        return _prefill(query, k_cache, v_cache, kv_rows, plan.prefills[0], scale)
    out = torch.empty_like(query)
    if decoded is not None:
        out[:decoded.shape[0]] = decoded
    for g in plan.decodes:
        out[g.lo:g.hi] = _decode(query[g.lo:g.hi], k_cache, v_cache, kv_rows, g, scale)
    for p in plan.prefills:
        out[p.lo:p.hi] = _prefill(query[p.lo:p.hi], k_cache, v_cache, kv_rows, p, scale)
    return out


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_rows: torch.Tensor | None,
            g: DecodeGroup, scale: float) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    keys, values = gather(k_cache, v_cache, kv_rows, g.rows, batch, g.length)
    # GQA without repeating K/V: the query heads of one KV head become that head's query rows.
    work = torch.promote_types(query.dtype, keys.dtype)
    keys, values = keys.to(work), values.to(work)
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).to(work)
    out = F.scaled_dot_product_attention(q, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=g.mask,
                                         scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def _prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_rows: torch.Tensor | None,
             p: PrefillSeq, scale: float) -> torch.Tensor:
    keys, values = gather(k_cache, v_cache, kv_rows, p.rows, 1, p.length)
    work = _prefill_dtype(query.dtype, keys.dtype, p.hi - p.lo)
    # [1, H, q, D] against [1, Hkv, L, D] with enable_gqa, and SDPA's own causal mask for a whole prompt:
    # torch's CPU flash kernel takes this form, 2-3x faster (measured on the embedded model's shapes, 128-512
    # tokens) than the query heads of a KV head stacked into one [G * q] matrix with an explicit mask.
    out = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0).to(work),
                                         keys[:, 0].unsqueeze(0).to(work), values[:, 0].unsqueeze(0).to(work),
                                         attn_mask=p.mask, is_causal=p.causal, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(query.dtype)


def _prefill_dtype(query: torch.dtype, cache: torch.dtype, rows: int) -> torch.dtype:
    """A float32 query over a bfloat16 cache attends in float32 (rounding the query too would add error the
    cache did not), except in chunks of PREFILL_BF16_MIN_ROWS query rows or more: there the int4 linears that
    made the query already rounded their inputs (to int8, or to bfloat16 for oneDNN), and torch's flash kernel
    runs bfloat16 on AMX / AVX512-BF16 at ~3x its float32 rate (a 512-token prompt: 2.86 -> 0.93 ms a layer at
    the 135M model's 9 heads; 512-token prefill +25 % at 135M, +14 % at 360M, docs/cpu_performance.md)."""
    if cache == torch.bfloat16 and query == torch.float32 and rows >= PREFILL_BF16_MIN_ROWS and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.promote_types(query, cache)
