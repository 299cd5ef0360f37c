"""The non-GEMM work of decode layers on CPU, before (the old ops, kept below) vs after (the CPU attention backend's kernels/cpu_attention.py, kernels/torch_fused.py).

    python scripts/bench_cpu_layer_ops.py --out benchmarks/cpu_attention.md

Shapes are SmolLM2-135M's (hidden 576, 9 query heads, 3 KV heads, head_dim 64, intermediate 1536), bf16,
block size 16, the KV cache one [2, blocks, heads, 16, 64] tensor as the model runner allocates it.
One "step" is what a forward pass does outside the GEMMs in `layers` layers: per layer the input norm
(with residual), q/k rope, cache write, paged attention, the post-attention norm and SiLU*mul; every step
gets new metadata, as the runner builds it, so per-step work (index plans) is counted once per step.
"attention" times the cache write + paged attention alone. All layers share one cache (a real model has
one per layer: long contexts are cold in cache either way, short ones may be warmer here).

The machine is shared and noisy: A and B alternate, each repetition times both, and the table reports
the median over repetitions of each one's time and of the per-repetition ratio before / after.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_attention, torch_fused
from pagedserve.kernels.metadata import AttentionMetadata

HIDDEN, HQ, HKV, D, INTER, BS = 576, 9, 3, 64, 1536, 16
DT = torch.bfloat16


# ---- before: the ops as they were (kernels/reference.py at the start of issue 14) ----

def old_write_kv_cache(key, value, k_cache, v_cache, slot_mapping):
    block_size = k_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping
    if not bool(valid.all()):
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value.to(v_cache.dtype)


def old_gather_context(cache, block_tables, length):
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    nblocks = -(-length // block_size)
    ids = block_tables[:, :nblocks].reshape(-1).long()
    seqs = block_tables.shape[0]
    out = torch.empty(num_kv_heads, seqs * nblocks, block_size * head_dim, dtype=cache.dtype, device=cache.device)
    rows = cache.view(num_blocks, num_kv_heads, block_size * head_dim)
    for h in range(num_kv_heads):
        torch.index_select(rows[:, h], 0, ids, out=out[h])
    return out.view(num_kv_heads, seqs, nblocks * block_size, head_dim)[:, :, :length]


def old_decode(query, k_cache, v_cache, block_tables, seq_lens, max_len, scale):
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    keys = old_gather_context(k_cache, block_tables, max_len).transpose(0, 1)
    values = old_gather_context(v_cache, block_tables, max_len).transpose(0, 1)
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).to(keys.dtype)
    mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def old_prefill(query, k_cache, v_cache, block_table, seq_len, scale):
    qlen, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    keys = old_gather_context(k_cache, block_table, seq_len)[:, 0]
    values = old_gather_context(v_cache, block_table, seq_len)[:, 0]
    q = query.view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * qlen, head_dim).to(keys.dtype)
    q_pos = torch.arange(seq_len - qlen, seq_len, device=query.device).repeat(group)
    mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    out = out.view(num_kv_heads, group, qlen, head_dim).permute(2, 0, 1, 3)
    return out.reshape(qlen, num_heads, head_dim).to(query.dtype)


def old_paged_attention(query, k_cache, v_cache, meta, scale):
    out = torch.empty_like(query)
    for lo in range(0, meta.num_decodes, 16):
        hi = min(lo + 16, meta.num_decodes)
        out[lo:hi] = old_decode(query[lo:hi], k_cache, v_cache, meta.block_tables[lo:hi],
                                meta.seq_lens[lo:hi], max(meta.seq_lens_cpu[lo:hi]), scale)
    starts = meta.query_start_loc_cpu
    for i in range(meta.num_decodes, meta.num_seqs):
        lo, hi = starts[i], starts[i + 1]
        if hi > lo:
            out[lo:hi] = old_prefill(query[lo:hi], k_cache, v_cache, meta.block_tables[i:i + 1],
                                     meta.seq_lens_cpu[i], scale)
    return out


def old_qk_rope(qk, cos, sin, num_q_heads):
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return qk * cos + rotated * sin


OLD = {"write": old_write_kv_cache, "attn": old_paged_attention, "rope": old_qk_rope}
NEW = {"write": lambda k, v, kc, vc, slots: cpu_attention.write_kv_cache(k, v, kc, vc, cpu_attention.write_plan(slots, kc)),
       "attn": cpu_attention.attend, "rope": lambda qk, cos, sin, nq: torch_fused.qk_norm_rope(qk, cos, sin, nq)}


# ---- the workload ----

def make_step(batch: int, ctx: int, prefill: bool, kv: torch.Tensor, gen: torch.Generator) -> dict:
    """One step's inputs: `batch` decodes with contexts up to ctx (ragged, longest first, as the
    runner sorts them), or one prefill of ctx new tokens."""
    num_blocks = kv.shape[1]
    if prefill:
        lens, tokens, starts = [ctx], ctx, [0, ctx]
    else:
        lens = [ctx] if batch == 1 else sorted(torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen).tolist(),
                                               reverse=True)
        tokens, starts = batch, list(range(batch + 1))
    width = -(-max(lens) // BS)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens]).to(torch.int32)
    if prefill:
        slots = torch.stack([tables[0, p // BS] * BS + p % BS for p in range(ctx)]).long()
    else:
        slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                             num_decodes=0 if prefill else batch, max_query_len=ctx if prefill else 1,
                             max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens)
    angles = torch.randn(tokens, 1, D // 2, generator=gen)
    return {"meta": meta, "h": torch.randn(tokens, HIDDEN, generator=gen).to(DT),
            "qkv": torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen).to(DT),
            "gate_up": torch.randn(tokens, 2 * INTER, generator=gen).to(DT),
            "cos": torch.cat((angles.cos(), angles.cos()), -1).to(DT),
            "sin": torch.cat((angles.sin(), angles.sin()), -1).to(DT),
            "norm_w": torch.randn(HIDDEN, generator=gen).to(DT)}


def layer_ops(ops: dict, s: dict, kv: torch.Tensor, attention_only: bool) -> None:
    """One layer's non-GEMM ops (GEMM outputs replaced by the fixed random tensors in s)."""
    meta, qkv, tokens = s["meta"], s["qkv"], s["qkv"].shape[0]
    if not attention_only:
        torch_fused.rms_norm(s["h"], s["norm_w"], 1e-5, s["h"])
        qk = ops["rope"](qkv[:, :(HQ + HKV) * D].view(tokens, HQ + HKV, D), s["cos"], s["sin"], HQ)
        q, k = qk[:, :HQ], qk[:, HQ:]
    else:
        q, k = qkv[:, :HQ * D].view(tokens, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(tokens, HKV, D)
    ops["write"](k, v, kv[0], kv[1], meta.slot_mapping)
    ops["attn"](q, kv[0], kv[1], meta, D ** -0.5)
    if not attention_only:
        torch_fused.rms_norm(s["h"], s["norm_w"], 1e-5, s["h"])
        torch_fused.silu_and_mul(s["gate_up"])


def time_steps(ops: dict, steps: list[dict], kv: torch.Tensor, layers: int, attention_only: bool) -> float:
    """Microseconds per layer over the given steps (each a new metadata object)."""
    t0 = time.perf_counter()
    for s in steps:
        s = dict(s, meta=_fresh(s["meta"]))
        for _ in range(layers):
            layer_ops(ops, s, kv, attention_only)
    return (time.perf_counter() - t0) / (len(steps) * layers) * 1e6


def _fresh(meta: AttentionMetadata) -> AttentionMetadata:
    """A new metadata object over new tensor objects (what the runner hands each step)."""
    return AttentionMetadata(meta.slot_mapping.clone(), meta.query_start_loc.clone(), meta.seq_lens.clone(),
                             meta.block_tables.clone(), meta.num_decodes, meta.max_query_len, meta.max_seq_len,
                             list(meta.query_start_loc_cpu), list(meta.seq_lens_cpu))


def ab(fn_a: Callable[[], float], fn_b: Callable[[], float], reps: int) -> tuple[float, float, float]:
    """Alternating A/B: (median A, median B, median of A/B per repetition)."""
    fn_a(), fn_b()                          # warm up both
    a, b = [], []
    for r in range(reps):
        first, second = (fn_a, fn_b) if r % 2 == 0 else (fn_b, fn_a)
        x, y = first(), second()
        a.append(x if r % 2 == 0 else y)
        b.append(y if r % 2 == 0 else x)
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def profile(batch: int, ctx: int, layers: int, kv: torch.Tensor, gen: torch.Generator) -> list[str]:
    """Where the time goes: aten ops per layer and their share of self CPU time, before and after."""
    from torch.profiler import profile as torch_profile
    steps = [make_step(batch, ctx, False, kv, gen) for _ in range(4)]
    lines = []
    for label, ops in (("before", OLD), ("after", NEW)):
        time_steps(ops, steps, kv, layers, False)
        with torch_profile() as prof:
            time_steps(ops, steps, kv, layers, False)
        events = [e for e in prof.key_averages() if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events)
        calls = sum(e.count for e in events) / (len(steps) * layers)
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
        shares = ", ".join(f"{e.key[6:]} {100 * e.self_cpu_time_total / total:.0f}% "
                           f"({e.count / (len(steps) * layers):.1f}/layer)" for e in top)
        lines.append(f"- {label}, decode batch {batch} ctx {ctx}: {calls:.0f} aten calls per layer "
                     f"(views included); self time: {shares}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30, help="layers per step (SmolLM2-135M has 30)")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--profile", action="store_true", help="also profile batch 1 and 64 at the first context")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for this run (default: torch's); on an oversubscribed machine every "
                         "op big enough to go parallel waits for a second core, which swamps what is measured")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    shapes = [(b, c, False) for b in (int(x) for x in args.batches.split(",")) for c in contexts]
    shapes += [(1, c, True) for c in contexts if c <= 512]
    num_blocks = 64 * (max(contexts) // BS + 1) + 8
    kv = torch.randn(2, num_blocks, HKV, BS, D, generator=gen).to(DT)
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.layers} layers per step, "
             f"median of {args.reps} alternating repetitions", "",
             "| shape | ops | before µs/layer | after µs/layer | before/after (median of ratios) |",
             "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch, ctx, prefill in shapes:
        work = batch * ctx * (ctx if prefill else 1)
        nsteps = max(1, min(8, int(2e6 // max(work, 1))))
        layers = args.layers if work <= 64 * 512 else max(2, args.layers // 10)
        steps = [make_step(batch, ctx, prefill, kv, gen) for _ in range(nsteps)]
        name = f"prefill {ctx}" if prefill else f"decode batch {batch}, ctx {ctx}"
        for attention_only in (False, True):
            a, b, ratio = ab(lambda: time_steps(OLD, steps, kv, layers, attention_only),
                             lambda: time_steps(NEW, steps, kv, layers, attention_only), args.reps)
            row = (f"| {name} | {'write + attention' if attention_only else 'all non-GEMM'} | {a:.0f} | {b:.0f} "
                   f"| {ratio:.2f}x |")
            lines.append(row)
            print(row, flush=True)
    if args.profile:
        lines += ["", "Profile (torch.profiler, aten self CPU time, all non-GEMM ops of a layer):"]
        for batch in (1, 64):
            for line in profile(batch, contexts[0], args.layers, kv, gen):
                lines.append(line)
                print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
