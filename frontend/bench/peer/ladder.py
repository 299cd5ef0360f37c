"""`pagedserve bench ladder`: CPU speed at real model sizes (issue 25). llama.cpp's llama-server and pagedserve
on a ladder of SmolLM2-shaped Llama models (135m, 360m, 1.7b; random weights) in Q4_0, Q8_0 and Q4_K_M, each file
made by llama.cpp's own converter and llama-quantize (ladder_models.py; cached, built once).

Per file, both engines on THREADS threads each (pagedserve in its own process with OMP_NUM_THREADS, llama-server
with -t), alternating (the order flips every repeat, so a drifting machine costs both alike):
  S1       single-stream decode ms/token: 128 prompt ids, (t(n+1 tokens) - t(1 token)) / n, n = --single-out
           (`pagedserve bench peer`'s measure); llama-server also reports its own
  bound    the floor of S1: the GGUF's weight bytes read once at the machine's read bandwidth (1 GiB of
           float32 summed, best of 5, THREADS threads); bound fraction = floor / S1 (1.0: at the floor)
  prefill  tok/s of one 512-token prompt with max_tokens 1, best of 2 after a warm-up; nothing cached
           (llama-server: cache_prompt false; pagedserve: enable_prefix_caching false)
  W1       output tok/s of W1's first N requests sent at once (N: 64, 64, 16 by size; --num-requests)
  RSS      each engine's peak RSS
  serving  `pagedserve bench serve` (W1, --ignore-eos) against each server in turn, one format per size
           (--serve-format), two rates per size (--rates), each rate on a freshly started server (the same
           prompts at both rates: no cache of the first run answers the second); labels "ENGINE SIZE FORMAT"
Every request runs greedy with ignore_eos and its token count is checked: random weights must not stop early.
Every engine run (and every bench serve rate) appends one JSON line to --result-file; the tables are printed.

    pagedserve bench ladder --repeats 1 --result-file benchmarks/results/cpu_ladder.jsonl \\
        --plot benchmarks/results/cpu_ladder.png                                 # the full ladder
    pagedserve bench ladder --build-only                                         # the model files only
    pagedserve bench ladder --sizes tiny --formats Q4_0 Q8_0 --num-requests tiny=4 \\
        --rates tiny=2,4 --single-out 16 --result-file /tmp/ladder_smoke.jsonl --plot /tmp/ladder_smoke.png
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from pagedserve.frontend.bench.peer import ladder_models as lm
from pagedserve.frontend.bench.peer import ladder_report
from pagedserve.frontend.bench.peer.child import report, run_child
from pagedserve.frontend.bench.peer.engines import PEER, decode_ms, engine_args_overrides, single_prompt, w1_requests
from pagedserve.frontend.bench.peer.ladder_serve import LLAMA_CTX, LLAMA_PARALLEL, serve_size
from pagedserve.frontend.bench.peer.llama_server import LlamaServer, find_llama_server
from pagedserve.frontend.bench.peer.llama_server import version as llama_version
from pagedserve.frontend.bench.results import append_result, read_results, run_metadata

ENGINES = (PEER, "pagedserve")
PREFILL_LEN = 512


def prefill_prompt(n: int = PREFILL_LEN) -> list[int]:
    rng = random.Random(2)
    return [rng.randrange(100, 49000) for _ in range(n)]


def best_pass(run: Callable[[], Any], passes: int = 2) -> tuple[float, Any]:
    """(seconds, output) of the fastest of `passes` calls after one warm-up call."""
    run()
    best: tuple[float, Any] = (float("inf"), None)
    for _ in range(passes):
        start = time.perf_counter()
        out = run()
        best = min(best, (time.perf_counter() - start, out), key=lambda b: b[0])
    return best


def run_llama(cfg: dict[str, Any]) -> dict[str, Any]:
    server = LlamaServer(cfg["llama_server"], cfg["gguf"], cfg["threads"], LLAMA_PARALLEL, LLAMA_CTX)
    try:
        ms, own_ms = server.single_stream(single_prompt(cfg), cfg["single_out"])
        prompt = prefill_prompt()
        prefill_s, out = best_pass(lambda: server.complete(prompt, 1))
        w1_s, tokens = server.run_batch(w1_requests(cfg))
    finally:
        peak = server.stop()
    return {"ms_per_token": ms, "own_ms_per_token": own_ms, "prefill_s": prefill_s,
            "own_prefill_tok_s": float(out["timings"]["prompt_per_second"]), "w1_seconds": w1_s,
            "w1_output_tokens": tokens, "peak_rss_mib": peak}


def child_main(payload: str) -> None:
    """In the child (child.py): pagedserve's measurements, in a process of their own so OMP_NUM_THREADS and
    ru_maxrss are its alone."""
    import torch
    from pagedserve.common.params.sampling_params import SamplingParams
    from pagedserve.frontend.offline.llm import LLM
    cfg = json.loads(payload)
    llm = LLM(cfg["gguf"], **cfg["options"])

    def generate(prompts: list[list[int]], lengths: list[int]) -> None:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        for out, n in zip(llm.generate(prompts, params, use_tqdm=False), lengths):
            if len(out.outputs[0].token_ids) != n:
                raise RuntimeError(f"pagedserve made {len(out.outputs[0].token_ids)} tokens, asked for {n}")

    prompt, long_prompt = single_prompt(cfg), prefill_prompt()
    ms = decode_ms(lambda n: generate([prompt], [n]), cfg["single_out"])
    prefill_s, _ = best_pass(lambda: generate([long_prompt], [1]))
    reqs = w1_requests(cfg)
    start = time.perf_counter()
    generate([p for p, _ in reqs], [m for _, m in reqs])
    w1_s = time.perf_counter() - start
    llm.shutdown()
    result = {"ms_per_token": ms, "prefill_s": prefill_s, "w1_seconds": w1_s,
              "w1_output_tokens": sum(m for _, m in reqs), "torch_threads": torch.get_num_threads(),
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "subprocess_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
    report(result)


def run_pagedserve(cfg: dict[str, Any]) -> dict[str, Any]:
    return run_child(__name__, json.dumps(cfg), cfg["threads"], "pagedserve")


def measure(engine: str, cfg: dict[str, Any], bound: float) -> dict[str, Any]:
    """One engine's run on one file; a failure becomes {"error": ...} so the rest of the ladder still runs."""
    start = time.perf_counter()
    try:
        r = run_llama(cfg) if engine == PEER else run_pagedserve(cfg)
    except Exception as exc:             # noqa: BLE001 - recorded and reported; the next run goes on
        return {"error": f"{type(exc).__name__}: {exc}", "wall_s": time.perf_counter() - start}
    r["w1_tok_s"] = r["w1_output_tokens"] / r["w1_seconds"]
    r["prefill_tok_s"] = PREFILL_LEN / r["prefill_s"]
    r["bound_fraction"] = lm.bound_fraction(bound, r["ms_per_token"])
    r["wall_s"] = time.perf_counter() - start
    return r


def file_info(base: dict[str, Any], size: str, fmt: str, path: str) -> dict[str, Any]:
    weight_bytes = lm.gguf_weight_bytes(path)
    return {**base, "size": size, "format": fmt, "gguf": path, "gguf_weight_bytes": weight_bytes,
            "gguf_tensor_types": lm.gguf_tensor_types(path),
            "bound_ms": lm.bound_ms(weight_bytes, base["bandwidth_gib_s"])}


def run_ladder(args: argparse.Namespace, files: dict[str, dict[str, str]], llama_server: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
        records.append(record)
        if args.result_file:
            append_result(args.result_file, record)

    import torch  # noqa: F401 - imported so that run_metadata records its version
    base = {"ladder_run": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "threads": args.threads, "llama_server_version": llama_version(llama_server),
            **lm.measure_bandwidth(args.threads)}
    progress(f"read bandwidth {base['bandwidth_gib_s']:.2f} GiB/s on {args.threads} threads")
    for size in args.sizes:
        for fmt in () if args.serve_only else args.formats:
            offline_runs(args, file_info(base, size, fmt, files[size][fmt]), llama_server, emit)
        if args.serve:
            fmt = args.serve_format
            info = file_info(base, size, fmt, files[size][fmt])
            cfg = {"gguf": info["gguf"], "threads": args.threads, "llama_server": llama_server,
                   "user_options": args.pagedserve_options}
            serve_size(args, size, info, cfg, emit)
    return records


def offline_runs(args: argparse.Namespace, info: dict[str, Any], llama_server: str,
                 emit: Callable[[dict[str, Any]], None]) -> None:
    """Every engine's --repeats runs on one file, the order flipped every repeat."""
    size, fmt = info["size"], info["format"]
    options = {"enable_prefix_caching": False, **args.pagedserve_options}
    cfg = {"gguf": info["gguf"], "threads": args.threads, "num_requests": args.num_requests[size],
           "max_tokens": None, "single_in": 128, "single_out": args.single_out,
           "prefill_len": PREFILL_LEN, "llama_server": llama_server, "options": options}
    for rep in range(args.repeats):
        for engine in args.engine if rep % 2 == 0 else args.engine[::-1]:
            # The VM's read bandwidth moved between 43 and 74 GiB/s within an hour (other tenants):
            # each engine's floor is measured in the minute of its own run.
            bw = lm.measure_bandwidth(args.threads)
            bound = lm.bound_ms(info["gguf_weight_bytes"], bw["bandwidth_gib_s"])
            r = measure(engine, cfg, bound)
            progress(f"{engine} {size} {fmt} run {rep + 1}: " + summary(r))
            emit({**run_metadata("cpu_ladder", f"{engine} {size} {fmt}", getattr(args, "command_line", None)),
                  **info, **bw, "bound_ms": bound, "run": rep + 1,
                  "engine": engine, "engine_options": options if engine != PEER else {},
                  **{k: cfg[k] for k in ("num_requests", "single_in", "single_out", "prefill_len")}, **r})


def progress(msg: str) -> None:
    print(f"bench ladder: {msg}", file=sys.stderr, flush=True)


def summary(r: dict[str, Any]) -> str:
    if "error" in r:
        return "FAILED " + r["error"].splitlines()[0]
    return (f"S1 {r['ms_per_token']:.2f} ms/token, prefill {r['prefill_tok_s']:.0f} tok/s, W1 {r['w1_tok_s']:.1f} "
            f"tok/s, peak RSS {r['peak_rss_mib']:.0f} MiB ({r['wall_s']:.0f} s)")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", nargs="+", choices=list(lm.SIZES), default=list(lm.DEFAULT_SIZES))
    p.add_argument("--formats", nargs="+", choices=lm.FORMATS, default=list(lm.DEFAULT_FORMATS))
    p.add_argument("--engine", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--repeats", type=int, default=1, help="runs of every engine on every file, alternating")
    p.add_argument("--threads", type=int, default=2, help="threads of every engine (and of the bandwidth probe)")
    p.add_argument("--single-out", type=int, default=128, help="S1's output tokens (fewer: quick checks only)")
    p.add_argument("--num-requests", nargs="+", action="extend", default=[], metavar="SIZE=N",
                   help=f"W1 requests per size (default {lm.NUM_REQUESTS})")
    p.add_argument("--serve-prompts", nargs="+", action="extend", default=[], metavar="SIZE=N",
                   help=f"bench serve's requests per size (default {lm.SERVE_PROMPTS})")
    p.add_argument("--rates", nargs="+", action="extend", default=[], metavar="SIZE=R1,R2",
                   help=f"bench serve's request rates per size (default {lm.RATES})")
    p.add_argument("--serve-format", choices=lm.FORMATS, default="Q4_0", help="the one format served per size")
    p.add_argument("--no-serve", dest="serve", action="store_false", help="skip bench serve")
    p.add_argument("--serve-only", action="store_true", help="bench serve alone (no offline runs)")
    p.add_argument("--pagedserve-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineArgs field for pagedserve (engine-serve's flag name with _), repeatable")
    p.add_argument("--cache", default=None, help="the ladder's model files (default: PAGEDSERVE_CACHE_DIR/ladder)")
    p.add_argument("--llama-cache", default=None, help="build_llama_server.sh's cache folder")
    p.add_argument("--result-file", default=None, help="append one JSON line per run to this file")
    p.add_argument("--plot", default=None, help="PNG of S1 and W1 against weight size (from --result-file)")
    p.add_argument("--build-only", action="store_true", help="make the model files and stop")


def check_args(args: argparse.Namespace) -> None:
    """Size maps filled in from the defaults, pagedserve's options typed; ValueError naming the flag (reported
    as a usage error)."""
    for name in ("repeats", "threads", "single_out"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    args.num_requests = {**lm.NUM_REQUESTS, **lm.parse_size_map(args.num_requests, lm.positive_int,
                                                                "--num-requests")}
    args.serve_prompts = {**lm.SERVE_PROMPTS, **lm.parse_size_map(args.serve_prompts, lm.positive_int,
                                                                  "--serve-prompts")}
    args.rates = {**lm.RATES, **lm.parse_size_map(args.rates, lm.rates, "--rates")}
    raw: dict[str, str] = {}
    for item in args.pagedserve_option:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--pagedserve-option: {item!r} is not key=value")
        raw[key.strip()] = value.strip()
    args.pagedserve_options = engine_args_overrides("pagedserve", raw)
    if args.pagedserve_options.get("enable_prefix_caching"):
        raise ValueError("--pagedserve-option: prefix caching stays off (the prefill pass repeats one prompt)")
    args.engine = list(dict.fromkeys(args.engine))
    if args.serve_only and not args.serve:
        raise ValueError("--serve-only and --no-serve leave nothing to run")


def main(args: argparse.Namespace) -> None:
    from pagedserve.common import envs
    cache = args.cache or os.path.join(envs.PAGEDSERVE_CACHE_DIR, "ladder")
    llama_server = find_llama_server(args.llama_cache)
    quantize_bin, llama_src = lm.llama_tools(llama_server)
    formats = list(dict.fromkeys(args.formats + ([args.serve_format] if args.serve else [])))
    files = {size: lm.build(cache, size, formats, quantize_bin, llama_src,
                            args.threads) for size in args.sizes}
    if args.build_only:
        print("\n".join(p for by_fmt in files.values() for p in by_fmt.values()))
        return
    records = run_ladder(args, files, llama_server)
    print(ladder_report.format_tables(records))
    print(ladder_report.format_serve_tables(records))
    if args.plot:
        ladder_report.plot_ladder(args.plot, read_results(args.result_file) if args.result_file else records)
        progress(f"plot written to {args.plot}")
