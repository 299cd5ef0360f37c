"""Attention backends picked once (per device and cache dtype, when a layer's cache is bound), and decodes of
several query tokens each (speculative decoding verifying a draft) against dense attention: through each CPU
backend's impl (cache write included), and through a whole model's layers against a plain prefill."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve.executor.model.layers.attention import PagedAttention
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.attention.backends import (CpuAttentionBackend, CpuAttentionImpl, ReferenceAttentionImpl,
                                                  TorchReferenceAttentionBackend, TritonAttentionBackend,
                                                  get_attn_backend)
from pagedserve.kernels.attention.interface import AttentionMetadataBuilder
from pagedserve.kernels.attention.kv_quant import FP8_KV_DTYPE
from pagedserve.kernels.ops import triton_usable
from pagedserve.tests.helpers.kernels.attention_cases import dense_attention, gather


def test_backend_follows_device_and_cache_dtype():
    assert get_attn_backend("cpu", torch.float32) is CpuAttentionBackend
    assert get_attn_backend(torch.device("cpu"), torch.bfloat16) is CpuAttentionBackend
    assert get_attn_backend("cpu", FP8_KV_DTYPE) is TorchReferenceAttentionBackend
    want = TritonAttentionBackend if triton_usable() else TorchReferenceAttentionBackend
    assert get_attn_backend("cuda", torch.bfloat16) is want


def test_binding_a_cache_makes_the_layers_impl():
    layer = PagedAttention(4, 2, 16, 0.25)
    with pytest.raises(RuntimeError, match="not bound"):
        layer(torch.zeros(1, 64), torch.zeros(1, 32), torch.zeros(1, 32), None)
    layer.kv_cache = torch.zeros(2, 3, 2, 4, 16)
    assert isinstance(layer.impl, CpuAttentionImpl) and layer.impl.in_place
    layer.kv_cache = torch.zeros(2, 3, 2, 4, 16, dtype=FP8_KV_DTYPE)
    assert isinstance(layer.impl, ReferenceAttentionImpl)
    windowed = PagedAttention(4, 2, 16, 0.25, sliding_window=8)
    windowed.bind_kv_cache(torch.zeros(2, 3, 2, 4, 16), CpuAttentionBackend)
    assert isinstance(windowed.impl, CpuAttentionImpl) and not windowed.impl.in_place
    windowed.kv_cache = None
    assert windowed.impl is None


def _verify_batch(decodes: list[int], draft: int, chunks: list[tuple[int, int]], block_size: int, hkv: int, d: int,
                  gen: torch.Generator, dtype: torch.dtype = torch.float32):
    """decodes: contexts (incl. the draft) of sequences verifying `draft` + 1 tokens, then prefill chunks
    (context, new tokens). A stacked [2, ...] cache holding random cached K/V; the new tokens' slots follow."""
    seqs = [(ctx, draft + 1) for ctx in decodes] + chunks
    num_blocks = 2 + sum(-(-ctx // block_size) for ctx, _ in seqs)
    kv = torch.randn(2, num_blocks, hkv, block_size, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-ctx // block_size))] for ctx, _ in seqs]
    starts, slots = [0], []
    for (ctx, new), table in zip(seqs, tables):
        starts.append(starts[-1] + new)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - new, ctx)]
    width = max(map(len, tables))
    lens = [ctx for ctx, _ in seqs]
    meta = AttentionMetadataBuilder(CpuAttentionBackend).build(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=len(decodes), max_query_len=max(n for _, n in seqs), max_seq_len=max(lens),
        query_start_loc_cpu=starts, seq_lens_cpu=lens, decode_query_len=draft + 1)
    return kv, tables, seqs, meta


CASES = {"one_verify": ([40], 3, []), "verifies_ragged": ([5, 33, 17, 64], 2, []),
         "verifies_and_chunks": ([20, 9], 4, [(30, 30), (50, 6)]), "draft_of_one": ([16, 17], 1, [(12, 3)])}


@pytest.mark.parametrize("backend", [CpuAttentionBackend, TorchReferenceAttentionBackend])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 1.5)])
def test_multi_token_decodes_match_dense(backend, case, window, softcap):
    gen = torch.Generator().manual_seed(len(case))
    hq, hkv, d, block_size = 6, 2, 64, 8
    kv, tables, seqs, meta = _verify_batch(*CASES[case], block_size, hkv, d, gen)
    tokens = meta.query_start_loc_cpu[-1]
    q, k, v = (torch.randn(tokens, h, d, generator=gen) for h in (hq, hkv, hkv))
    layer = PagedAttention(hq, hkv, d, 1 / math.sqrt(d), sliding_window=window, logit_softcap=softcap)
    layer.bind_kv_cache(kv, backend)
    out = layer(q.flatten(1), k.flatten(1), v.flatten(1), meta).view(tokens, hq, d)
    for i, (ctx, _) in enumerate(seqs):
        lo, hi = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        keys, values = gather(kv[0], tables[i], ctx), gather(kv[1], tables[i], ctx)
        torch.testing.assert_close(keys[-(hi - lo):], k[lo:hi])          # this step's K/V were written
        torch.testing.assert_close(values[-(hi - lo):], v[lo:hi])
        want = dense_attention(q[lo:hi], keys, values, 1 / math.sqrt(d), window, softcap)
        torch.testing.assert_close(out[lo:hi], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", [CpuAttentionBackend, TorchReferenceAttentionBackend])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 1.5)])
def test_rows_that_see_past_themselves_match_dense(backend, window, softcap):
    """meta.visible_until (Gemma 3: an image's tokens see to its end) in a step of one-token decodes, a whole
    prompt with two spans, a chunk over cached context with a span, and a chunk without one."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, block_size = 6, 2, 32, 8
    kv, tables, seqs, meta = _verify_batch([14, 9], 0, [(30, 30), (40, 20), (25, 5)], block_size, hkv, d, gen)
    spans = {2: [(3, 13), (15, 25)], 3: [(22, 33)]}            # sequence -> item [start, end) positions
    until = []
    for i, (ctx, new) in enumerate(seqs):
        for pos in range(ctx - new, ctx):
            until.append(next((b - 1 for a, b in spans.get(i, []) if a <= pos < b), pos))
    meta.visible_until = torch.tensor(until)
    tokens = meta.query_start_loc_cpu[-1]
    q, k, v = (torch.randn(tokens, h, d, generator=gen) for h in (hq, hkv, hkv))
    layer = PagedAttention(hq, hkv, d, 1 / math.sqrt(d), sliding_window=window, logit_softcap=softcap)
    layer.bind_kv_cache(kv, backend)
    out = layer(q.flatten(1), k.flatten(1), v.flatten(1), meta).view(tokens, hq, d)
    widened = False
    for i, (ctx, _) in enumerate(seqs):
        lo, hi = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        keys, values = gather(kv[0], tables[i], ctx), gather(kv[1], tables[i], ctx)
        rows = meta.visible_until[lo:hi]
        want = dense_attention(q[lo:hi], keys, values, 1 / math.sqrt(d), window, softcap, rows)
        torch.testing.assert_close(out[lo:hi], want, rtol=1e-4, atol=1e-5)
        causal = dense_attention(q[lo:hi], keys, values, 1 / math.sqrt(d), window, softcap)
        widened |= not torch.allclose(causal, want, rtol=1e-4, atol=1e-5)
    assert widened


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")
def test_one_token_decodes_still_take_the_c_kernel():
    """The C decode kernel serves one-token decodes only; a verify step's decodes go the chunk path."""
    from pagedserve.kernels.attention import cpu_paged as cpu_attention
    gen = torch.Generator().manual_seed(5)
    for draft, taken in ((0, True), (2, False)):
        kv, _, _, meta = _verify_batch([30, 12], draft, [], 8, 2, 64, gen)
        q = torch.randn(meta.query_start_loc_cpu[-1], 6, 64, generator=gen)
        assert (cpu_attention.decode_native(q, kv[0], kv[1], meta, 0.125) is not None) == taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_verify_step_through_the_model_equals_its_prefill(tiny_llama_dir, dtype):
    """Prefill n - 4 tokens, then verify 4 more as one decode of 4 query tokens: the hidden states of those 4
    equal a prefill of all n at once (the layers, the CPU backend, the cache written by the first step)."""
    from pagedserve.executor.model.model_loader import load_model
    from pagedserve.executor.model.parallel_state import TPGroup
    from pagedserve.tests.helpers.models.tiny_models import bind_kv_cache, dense_prefill_metadata
    from pagedserve.tests.helpers.parity import model_config
    model = load_model(model_config(tiny_llama_dir, dtype="float32"), TPGroup())
    ids = torch.tensor([5, 77, 301, 42, 9, 120, 64, 33, 250, 17, 8, 99, 460, 3, 71, 200, 18, 44, 7])
    n, block_size = len(ids), 4
    blocks = -(-n // block_size)
    bind_kv_cache(model, blocks, block_size, dtype)
    whole = model(ids, torch.arange(n), dense_prefill_metadata(n, block_size, blocks))
    bind_kv_cache(model, blocks, block_size, dtype)
    model(ids[:n - 4], torch.arange(n - 4), dense_prefill_metadata(n - 4, block_size, blocks))
    meta = AttentionMetadataBuilder(CpuAttentionBackend).build(
        slot_mapping=torch.arange(n - 4, n), query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        num_decodes=1, max_query_len=4, max_seq_len=n, query_start_loc_cpu=[0, 4], seq_lens_cpu=[n],
        decode_query_len=4)
    verified = model(ids[n - 4:], torch.arange(n - 4, n), meta)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(verified, whole[n - 4:], **tol)


def test_builder_refuses_an_empty_decode():
    with pytest.raises(ValueError, match="decode_query_len"):
        AttentionMetadataBuilder(CpuAttentionBackend).build(
            slot_mapping=torch.zeros(0), query_start_loc=torch.zeros(1), seq_lens=torch.zeros(0),
            block_tables=torch.zeros(0, 1), num_decodes=0, max_query_len=0, max_seq_len=0,
            query_start_loc_cpu=[0], seq_lens_cpu=[], decode_query_len=0)
