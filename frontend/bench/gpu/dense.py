"""`pagedserve bench kernels`' dense part: paged attention (decode, split-KV and prefill, against torch SDPA),
the fused elementwise kernels against eager PyTorch, and the skinny decode GEMM against cuBLAS, each against its
bytes and FLOP floors. Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128), bf16, block
size 16. Needs CUDA and triton (kernels.py checks before importing this).
"""
from __future__ import annotations

import math

import torch
import triton

from pagedserve.frontend.bench.gpu.timing import DT, bench, bench_launched
from pagedserve.kernels import torch_fused
from pagedserve.kernels.attention import cpu_paged as cpu_attention
from pagedserve.kernels.attention import triton_cache
from pagedserve.kernels.attention import triton_paged as triton_attention
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.triton import fused as triton_fused
from pagedserve.kernels.triton import gemm as triton_gemm

HQ, HKV, D, BS = 16, 8, 128, 16
Row = tuple[str, float, float, float]       # (kernel, median ms, bytes floor ms, FLOP floor ms)


def attention_case(seqs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random caches and block tables for (context incl. new, new tokens) per sequence."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_needed = sum(-(-c // BS) for c, _ in seqs)
    k = torch.randn(blocks_needed + 8, HKV, BS, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn_like(k)
    perm = torch.randperm(blocks_needed + 8, device="cuda", generator=gen)
    width = max(-(-c // BS) for c, _ in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32, device="cuda")
    used = 0
    for i, (c, _) in enumerate(seqs):
        nb = -(-c // BS)
        tables[i, :nb] = perm[used:used + nb].int()
        used += nb
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device="cuda"), block_tables=tables,
        num_decodes=sum(n == 1 for _, n in seqs), max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c for c, _ in seqs), query_start_loc_cpu=starts, seq_lens_cpu=[c for c, _ in seqs])
    q = torch.randn(starts[-1], HQ, D, device="cuda", dtype=DT, generator=gen)
    return q, k, v, meta


def attention_rows(bw: float, flops: float) -> list[Row]:
    rows = []
    scale = 1 / math.sqrt(D)
    for batch, ctx in [(1, 1024), (1, 8192), (8, 4096), (64, 1024), (256, 1024), (256, 4096)]:
        for splits in (None, 1):
            q, k, v, meta = attention_case([(ctx, 1)] * batch)
            ms = bench(lambda: triton_attention.paged_attention(q, k, v, meta, scale, num_splits=splits))
            nbytes = batch * ctx * HKV * D * 2 * 2 + 2 * q.numel() * 2
            chosen = splits or triton_attention._num_splits(meta, HKV)
            rows.append((f"decode B={batch} ctx={ctx} splits={chosen}{'' if splits is None else ' (forced)'}",
                         ms, nbytes / bw * 1e3, 4 * batch * ctx * HQ * D / flops * 1e3))
    for seqs, label in [([(1024, 1024)] * 4, "prefill 4x1024"), ([(4096, 512)] * 2, "chunk 2x512 after 3584"),
                        ([(2048, 2048)], "prefill 1x2048")]:
        q, k, v, meta = attention_case(seqs)
        ms = bench(lambda: triton_attention.paged_attention(q, k, v, meta, scale))
        work = sum(2 * 2 * HQ * D * n * (c - n + (n + 1) / 2) for c, n in seqs)   # causal QK^T and PV
        nbytes = sum(c * HKV * D * 2 * 2 for c, _ in seqs) + 2 * q.numel() * 2
        rows.append((label, ms, nbytes / bw * 1e3, work / flops * 1e3))
        if len(set(seqs)) == 1 and seqs[0][0] == seqs[0][1]:
            # Peer: torch SDPA (flash) on the same dense, causal problem with K/V already contiguous.
            b, n = len(seqs), seqs[0][0]
            qd = q.view(b, n, HQ, D).transpose(1, 2)
            kd = torch.randn(b, HKV, n, D, device="cuda", dtype=DT)
            vd = torch.randn_like(kd)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            ms = bench(lambda: sdpa(qd, kd, vd, is_causal=True, enable_gqa=True))
            rows.append((f"  peer: torch SDPA dense {label}", ms, nbytes / bw * 1e3, work / flops * 1e3))
    return rows


def elementwise_rows(bw: float) -> list[Row]:
    rows = []
    t, hidden, inter = 256, 1024, 3072
    x = torch.randn(t, hidden, device="cuda", dtype=DT)
    res, w = torch.randn_like(x), torch.randn(hidden, device="cuda", dtype=DT)
    nbytes = 4 * x.numel() * 2
    rows.append(("rms_norm+residual T=256 (Triton)", bench(lambda: triton_fused.rms_norm(x, w, 1e-6, res)),
                 nbytes / bw * 1e3, 0.0))
    rows.append(("  eager PyTorch", bench(lambda: torch_fused.rms_norm(x, w, 1e-6, res)), nbytes / bw * 1e3, 0.0))
    g = torch.randn(t, 2 * inter, device="cuda", dtype=DT)
    nbytes = 3 * t * inter * 2
    rows.append(("silu_and_mul T=256 (Triton)", bench(lambda: triton_fused.silu_and_mul(g)), nbytes / bw * 1e3, 0.0))
    rows.append(("  eager PyTorch", bench(lambda: torch_fused.silu_and_mul(g)), nbytes / bw * 1e3, 0.0))
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", dtype=DT)
    qk = qkv[:, :(HQ + HKV) * D].view(t, HQ + HKV, D)
    cos, sin = torch.randn(t, 1, D, device="cuda", dtype=DT), torch.randn(t, 1, D, device="cuda", dtype=DT)
    qw, kw = torch.randn(D, device="cuda", dtype=DT), torch.randn(D, device="cuda", dtype=DT)
    nbytes = 2 * qk.numel() * 2
    rows.append(("qk_norm+rope T=256 (Triton)", bench(lambda: triton_fused.qk_norm_rope(qk, cos, sin, HQ, qw, kw)),
                 nbytes / bw * 1e3, 0.0))
    rows.append(("  eager PyTorch", bench(lambda: torch_fused.qk_norm_rope(qk, cos, sin, HQ, qw, kw)),
                 nbytes / bw * 1e3, 0.0))
    for tokens in (256, 4096):
        key = torch.randn(tokens, HKV, D, device="cuda", dtype=DT)
        val = torch.randn_like(key)
        kc = torch.randn(tokens // BS + 8, HKV, BS, D, device="cuda", dtype=DT)
        vc = torch.randn_like(kc)
        slots = torch.randperm(tokens + 8 * BS, device="cuda")[:tokens]
        nbytes = 4 * key.numel() * 2
        rows.append((f"write_kv_cache T={tokens} (Triton)",
                     bench(lambda: triton_cache.write_kv_cache(key, val, kc, vc, slots)), nbytes / bw * 1e3, 0.0))

        def reference() -> None:       # the plan is looked up inside the timed call (write_plan caches it)
            cpu_attention.write_kv_cache(key, val, kc, vc, cpu_attention.write_plan(slots, kc))
        rows.append(("  PyTorch index_put (syncs: timed with launches)", bench_launched(reference),
                     nbytes / bw * 1e3, 0.0))
    return rows


def gemm_rows(bw: float) -> list[Row]:
    """Qwen3-0.6B's decode GEMMs at M=1 and 8: the skinny Triton kernel against cuBLAS (F.linear).
    Weights rotate over enough copies to exceed L2, so each call streams its weight from HBM."""
    rows = []
    for n, k, name in [(4096, 1024, "qkv"), (1024, 2048, "o_proj"), (6144, 1024, "gate_up"),
                       (1024, 3072, "down"), (151936, 1024, "lm_head")]:
        copies = max(1, (256 << 20) // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=DT) for _ in range(copies)]
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=DT)
            nbytes = n * k * 2
            for label, fn in (("Triton skinny", triton_gemm.skinny_gemm),
                              ("  cuBLAS F.linear", torch.nn.functional.linear)):
                ms = bench(lambda: [fn(x, w) for w in weights]) / copies
                rows.append((f"{label} {name} M={m} N={n} K={k}", ms, nbytes / bw * 1e3, 0.0))
        del weights
    return rows


def table(bw: float, flops: float) -> str:
    """Every dense row as one markdown table, headed by the device and the measured ceilings."""
    props = torch.cuda.get_device_properties(0)
    lines = [f"Device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
             f"triton {triton.__version__}. Measured ceilings: copy {bw / 1e12:.2f} TB/s (read + write), "
             f"bf16 matmul {flops / 1e12:.0f} TFLOP/s.", "",
             "| kernel | median ms | bytes floor ms | FLOP floor ms | of floor |", "|---|---|---|---|---|"]
    for name, ms, byte_floor, flop_floor in attention_rows(bw, flops) + elementwise_rows(bw) + gemm_rows(bw):
        floor = max(byte_floor, flop_floor)
        lines.append(f"| {name} | {ms:.4f} | {byte_floor:.4f} | {flop_floor:.4f} | {floor / ms:.0%} |")
    return "\n".join(lines)
