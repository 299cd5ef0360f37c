"""KV tier benchmarks of issue 48 (docs/kv_tiers.md), on the embedded 135M model, each figure against its peer
measured in the same run, A/B alternated. One JSON line per measurement in --result-file.

  chat     --convs conversations x --turns turns (default 8 x 4), 1,500-3,000 tokens of history each, asked in
           turn, with the pool a quarter of the working set: TTFT p50/p99 and total time, the disk tier against
           none (recompute).
  restart  prompts of N tokens prefilled cold, then after a restart with the warm tier: TTFT of both, and the
           tier's load time for the N tokens' blocks (the cost swap pays instead of a prefill of N tokens).
  dd       the tier's own write/read bandwidth (its kv_transfer totals) against dd on the same folder.

  PYTHONPATH=.. python benchmarks/results/kv_tiers_ab.py --folder /var/tmp/kvbench --result-file \
      benchmarks/results/kv_tiers.jsonl chat restart dd
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import time
from typing import Any

import msgspec

from pagedserve import LLM, SamplingParams
from pagedserve.frontend.bench.results import append_result, run_metadata
from pagedserve.ipc.messages import SchedulerStats

BS = 16
ONE = SamplingParams(temperature=0, max_tokens=1)      # a request's wall time is its TTFT
VOCAB = (100, 40000)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def _llm(folder: str | None, max_model_len: int = 4096, **kwargs: Any) -> LLM:
    tier = {} if folder is None else {"kv_offloading_backend": "disk", "kv_offloading_path": folder,
                                      "kv_offloading_size": 4}
    llm = LLM(max_model_len=max_model_len, block_size=BS, **tier, **kwargs)
    llm.generate([{"prompt_token_ids": list(range(200, 456))}], ONE, use_tqdm=False)   # warm the kernels
    llm.reset_prefix_cache()
    return llm


def _ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE, use_tqdm=False)
    return time.perf_counter() - t0


def _stats(llm: LLM) -> SchedulerStats:
    return msgspec.convert(llm.client.call_utility("get_stats"), SchedulerStats)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def chat_turns(convs: int, turns: int, seed: int = 0) -> list[list[int]]:
    """Each conversation's prompt per turn, asked round robin (turn 1 of every conversation, then turn 2...):
    histories start at 1,500-2,200 tokens and grow by 250 a turn (a reply and the next user message)."""
    rng = random.Random(seed)
    histories = [_tokens(rng, 1500 + 700 * c // max(1, convs - 1)) for c in range(convs)]
    asked = []
    for _ in range(turns):
        for h in histories:
            asked.append(list(h))
            h.extend(_tokens(rng, 250))
    return asked


def bench_chat(args: argparse.Namespace) -> None:
    asked = chat_turns(args.convs, args.turns)
    working_blocks = sum(-(-len(p) // BS) for p in asked[-args.convs:])
    longest = max(map(len, asked)) + BS
    # A quarter of the working set, but never less than the longest request (the engine refuses a pool that
    # cannot hold max_model_len): with few conversations that is a little more than a quarter.
    pool = max(working_blocks // 4, -(-longest // BS) + 1)
    for rep in range(args.repeats):
        for mode in (("none", "disk") if rep % 2 == 0 else ("disk", "none")):
            folder = _fresh(args.folder) if mode == "disk" else None
            with _llm(folder, max_model_len=longest, num_gpu_blocks_override=pool) as llm:
                t0 = time.perf_counter()
                ttfts = [_ttft(llm, p) for p in asked]
                total = time.perf_counter() - t0
                st = _stats(llm)
            kv = st.kv_connector_stats
            _record(args, "chat", mode, rep, ttft_p50_s=statistics.median(ttfts), ttft_p99_s=_pct(ttfts, 0.99),
                    total_s=total, requests=len(asked), pool_blocks=pool, working_set_blocks=working_blocks,
                    tier_hit_tokens=st.external_prefix_cache_hits,
                    prompt_tokens=sum(map(len, asked)), ttfts_s=[round(t, 4) for t in ttfts],
                    load_s=kv.load_time_s if kv else 0.0, load_bytes=kv.load_bytes if kv else 0)


def bench_restart(args: argparse.Namespace) -> None:
    """Cold prefill of each prompt (a fresh tier fills), then a restarted engine on that tier: its TTFT and
    the seconds its loads took, per prompt length."""
    rng = random.Random(1)
    folder = _fresh(args.folder)
    lengths = [int(n) for n in args.lengths]
    seen = {n: _tokens(rng, n) for n in lengths}
    with _llm(folder) as llm:
        cold = {n: _ttft(llm, seen[n]) for n in lengths}
    with _llm(folder) as llm:           # the restart: an empty pool, the tier's index rebuilt from its files
        for n in lengths:
            before = _stats(llm).kv_connector_stats
            warm = _ttft(llm, seen[n])
            after = _stats(llm).kv_connector_stats
            _record(args, "restart", "disk", 0, prompt_tokens=n, cold_ttft_s=cold[n], warm_ttft_s=warm,
                    load_s=after.load_time_s - before.load_time_s, load_bytes=after.load_bytes - before.load_bytes,
                    loaded_tokens=after.block_hits * BS - before.block_hits * BS, speedup=cold[n] / warm)


def bench_dd(args: argparse.Namespace) -> None:
    """The tier's bandwidth (4 prompts of 1,024 tokens written, then read back) against dd writing and
    reading 512 MiB in the same folder, right after."""
    folder = _fresh(args.folder)
    rng = random.Random(2)
    prompts = [_tokens(rng, 1024) for _ in range(4)]
    with _llm(folder) as llm:
        for p in prompts:
            _ttft(llm, p)
        llm.reset_prefix_cache()
        for p in prompts:
            _ttft(llm, p)
        kv = _stats(llm).kv_connector_stats
    _record(args, "dd", "tier", 0, write_gib_s=kv.store_bytes / kv.store_time_s / (1 << 30),
            read_gib_s=kv.load_bytes / kv.load_time_s / (1 << 30), write_bytes=kv.store_bytes,
            read_bytes=kv.load_bytes)
    target = os.path.join(folder, "dd.bin")
    for label, cmd in (("write", ["dd", "if=/dev/zero", f"of={target}", "bs=1M", "count=512"]),
                       ("write_fdatasync", ["dd", "if=/dev/zero", f"of={target}", "bs=1M", "count=512",
                                            "conv=fdatasync"]),
                       ("read_cached", ["dd", f"if={target}", "of=/dev/null", "bs=1M"]),
                       ("read_direct", ["dd", f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        _record(args, "dd", f"dd_{label}", 0, gib_s=0.5 / (time.perf_counter() - t0))
    os.unlink(target)


def _fresh(folder: str) -> str:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    return folder


def _record(args: argparse.Namespace, bench: str, mode: str, rep: int, **fields: Any) -> None:
    line = {**run_metadata(f"kv_tiers_{bench}", mode), "repeat": rep, "loadavg_1m": os.getloadavg()[0], **fields}
    print({k: v for k, v in line.items() if k not in ("ttfts_s", "command")}, flush=True)
    append_result(args.result_file, line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benches", nargs="+", choices=("chat", "restart", "dd"))
    parser.add_argument("--folder", required=True, help="the tier's folder (emptied first)")
    parser.add_argument("--result-file", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--convs", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--lengths", nargs="+", default=["256", "1024", "3000"])
    args = parser.parse_args()
    for name in args.benches:
        {"chat": bench_chat, "restart": bench_restart, "dd": bench_dd}[name](args)


if __name__ == "__main__":
    main()
