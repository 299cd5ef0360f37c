"""`pagedserve bench peer`: side by side on CPU (issue 14), llama.cpp's llama-server, HF transformers and
pagedserve on one GGUF file.

Per engine and run: W1 output tok/s (pagedserve.frontend.bench.datasets.w1: 64 requests, all at once), single-stream
decode ms per output token (one request, 128 prompt ids; the wall-clock difference of a 1-token and a
129-token run, divided by 128, second pass of each kept; llama-server also reports its own
timings.predicted_per_token_ms), and peak RSS. Every engine runs in its own process, THREADS threads each;
engines alternate within each repeat, so slow drift of the machine hits all of them alike.

Engines (--engine, repeatable; default llama.cpp, hf, pagedserve, and pagedserve-int8 when EngineArgs has a
quantization field):
  llama.cpp                     llama-server -m GGUF -t THREADS -np 16 -c 12800 --cont-batching; W1 as token
                                ids to /completion (n_predict, ignore_eos, cache_prompt false), 16 in flight
  hf[:batch=16,dtype=bfloat16]  HF transformers, static batches
  pagedserve[-NAME][:k=v,...]   pagedserve's LLM on the GGUF; k=v sets any EngineArgs field (engine-serve's
                                flag names with _, e.g. pagedserve-int8:quantization=int8,max_num_seqs=64);
                                env.NAME=value sets an environment variable of its process, e.g.
                                pagedserve-nostep:env.PAGEDSERVE_CPU_DECODE_STEP=0

Every engine run appends one JSON line to --result-file; the tables are printed.

    pagedserve bench peer --repeats 3 --result-file benchmarks/results/cpu_peer.jsonl
    pagedserve bench peer --num-requests 4 --max-tokens 8 --single-out 8   # a quick check
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from typing import Any

from pagedserve.frontend.bench.hf_backend import hf_static_generate, load_hf_model
from pagedserve.frontend.bench.peer.child import report, run_child
from pagedserve.frontend.bench.peer.engines import (PEER, decode_ms, default_engines, default_gguf, parse_engine,
                                                    single_prompt, w1_requests)
from pagedserve.frontend.bench.peer.llama_server import LlamaServer, find_llama_server
from pagedserve.frontend.bench.peer.llama_server import version as llama_version
from pagedserve.frontend.bench.results import append_result, run_metadata


def run_pagedserve(cfg: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    import torch
    from pagedserve.common.params.sampling_params import SamplingParams
    from pagedserve.frontend.offline.llm import LLM

    llm = LLM(cfg["gguf"], **options)
    prompt = single_prompt(cfg)

    def one(n: int) -> None:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           use_tqdm=False)
        if len(out[0].outputs[0].token_ids) != n:
            raise RuntimeError(f"pagedserve made {len(out[0].outputs[0].token_ids)} tokens, asked for {n}")
    ms = decode_ms(one, cfg["single_out"])
    reqs = w1_requests(cfg)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for o, (_, m) in zip(outs, reqs):
        if len(o.outputs[0].token_ids) != m:
            raise RuntimeError(f"pagedserve made {len(o.outputs[0].token_ids)} tokens, asked for {m}")
    llm.shutdown()
    return {"seconds": seconds, "output_tokens": sum(m for _, m in reqs), "ms_per_token": ms,
            "threads": torch.get_num_threads()}


def run_hf(cfg: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    import torch
    model, device = load_hf_model(cfg["gguf"], options.get("dtype", "bfloat16"), "cpu")
    ids = torch.tensor([single_prompt(cfg)])

    def one(n: int) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
    ms = decode_ms(one, cfg["single_out"])
    reqs = w1_requests(cfg)
    start = time.perf_counter()
    tokens = hf_static_generate(model, device, reqs, int(options.get("batch", 16)))
    return {"seconds": time.perf_counter() - start, "output_tokens": tokens, "ms_per_token": ms,
            "threads": torch.get_num_threads()}


def run_llama(cfg: dict[str, Any]) -> dict[str, Any]:
    server = LlamaServer(cfg["llama_server"], cfg["gguf"], cfg["threads"], cfg["llama_parallel"],
                         cfg["llama_ctx"])
    try:
        ms, own_ms = server.single_stream(single_prompt(cfg), cfg["single_out"])
        reqs = w1_requests(cfg)
        seconds, tokens = server.run_batch(reqs)
    finally:
        peak = server.stop()
    return {"seconds": seconds, "output_tokens": tokens, "ms_per_token": ms, "own_ms_per_token": own_ms,
            "threads": cfg["threads"], "peak_rss_mib": peak}


def child_main(payload: str) -> None:
    """In the child (child.py): one pagedserve or HF engine's run, reported to the parent."""
    job = json.loads(payload)
    engine, cfg = job["engine"], job["cfg"]
    os.environ.update(engine.get("env", {}))       # read lazily (common/envs.py): before the engine starts
    run = run_pagedserve if engine["kind"] == "pagedserve" else run_hf
    result = run(cfg, engine["options"])
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Processes the engine started (none by default; torch.compile workers, a core process) apart, as the
    # largest of them: adding them up would count helpers that never hold the model.
    result["subprocess_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    report(result)


def run_engine(engine: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    if engine["kind"] == "llama":
        result = run_llama(cfg)
    else:
        result = run_child(__name__, json.dumps({"engine": engine, "cfg": cfg}), cfg["threads"], engine["name"])
    result["engine"] = engine["name"]
    result["tok_per_s"] = result["output_tokens"] / result["seconds"]
    return result


def fmt_ratio(value: float, peer: float | None) -> str:
    return f"{value / peer:.2f}x" if peer else "-"


def run_rows(runs: list[list[dict[str, Any]]]) -> list[str]:
    lines = ["| run | engine | W1 output tok/s | W1 vs llama.cpp | single stream ms/token | vs llama.cpp | "
             "llama.cpp's own ms/token | peak RSS MiB | threads |", "|---|---|---|---|---|---|---|---|---|"]
    for i, results in enumerate(runs, 1):
        peer = next((r for r in results if r["engine"] == PEER), None)
        for r in results:
            own = f"{r['own_ms_per_token']:.2f}" if "own_ms_per_token" in r else "-"
            sub = r.get("subprocess_peak_rss_mib", 0)
            rss = f"{r['peak_rss_mib']:.0f}" + (f" (+{sub:.0f} in subprocesses)" if sub >= 1 else "")
            lines.append(f"| {i} | {r['engine']} | {r['tok_per_s']:.1f} | "
                         f"{fmt_ratio(r['tok_per_s'], peer and peer['tok_per_s'])} | {r['ms_per_token']:.2f} | "
                         f"{fmt_ratio(r['ms_per_token'], peer and peer['ms_per_token'])} | {own} | {rss} | "
                         f"{r['threads']} |")
    return lines


def summary_rows(runs: list[list[dict[str, Any]]], names: list[str]) -> list[str]:
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for rs in runs for r in rs if r["engine"] == name)
    have_peer = PEER in names
    lines = ["| engine | W1 output tok/s | W1 vs llama.cpp | single stream ms/token | vs llama.cpp | "
             "peak RSS MiB |", "|---|---|---|---|---|---|"]
    for name in names:
        tps, ms, rss = median(name, "tok_per_s"), median(name, "ms_per_token"), median(name, "peak_rss_mib")
        lines.append(f"| {name} | {tps:.1f} | {fmt_ratio(tps, median(PEER, 'tok_per_s') if have_peer else None)} | "
                     f"{ms:.2f} | {fmt_ratio(ms, median(PEER, 'ms_per_token') if have_peer else None)} | {rss:.0f} |")
    return lines


def format_report(cfg: dict[str, Any], engines: list[dict[str, Any]], runs: list[list[dict[str, Any]]],
                  peer_version: str) -> str:
    import torch
    names = [e["name"] for e in engines]
    specs = "; ".join(f"{e['name']}: {json.dumps(e['options'])}" for e in engines if e["options"])
    head = [f"\n### CPU side by side on {os.path.basename(cfg['gguf'])} ({time.strftime('%Y-%m-%d %H:%M')}, "
            f"{cpu_name()}, {os.cpu_count()} cores, {cfg['threads']} threads each (column threads: what each "
            f"engine ran with); torch {torch.__version__}; llama-server {peer_version})\n",
            f"W1: {cfg['num_requests']} requests" + (f", max_tokens capped at {cfg['max_tokens']}"
                                                      if cfg["max_tokens"] else "") +
            f". Single stream: {cfg['single_in']} prompt ids, {cfg['single_out']} output tokens, batch 1, ms per "
            "output token = (t(n+1 tokens) - t(1 token)) / n. llama.cpp: -np "
            f"{cfg['llama_parallel']} -c {cfg['llama_ctx']} --cont-batching, {cfg['llama_parallel']} requests "
            f"in flight, every response checked for exactly max_tokens tokens. Ratios are engine / llama.cpp of "
            "the same run (tok/s: higher is better; ms/token: lower is better)." +
            (f" Engine options: {specs}." if specs else ""), ""]
    body = run_rows(runs)
    if len(runs) > 1:
        body += ["", f"Median of {len(runs)} runs (ratios of medians):", ""] + summary_rows(runs, names)
    return "\n".join(head + body)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", action="append", default=None,
                   help="name[:key=value,...], repeatable (see above); default: all of them")
    p.add_argument("--gguf", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1 file")
    p.add_argument("--threads", type=int, default=2, help="threads of every engine")
    p.add_argument("--repeats", type=int, default=1, help="runs of every engine, alternating")
    p.add_argument("--num-requests", type=int, default=64, help="W1 requests")
    p.add_argument("--max-tokens", type=int, default=None, help="cap W1's max_tokens (quick checks only)")
    p.add_argument("--single-in", type=int, default=128, help="single-stream prompt tokens")
    p.add_argument("--single-out", type=int, default=128, help="single-stream output tokens")
    p.add_argument("--llama-parallel", type=int, default=16, help="llama-server slots (-np)")
    p.add_argument("--llama-ctx", type=int, default=12800, help="llama-server context, all slots (-c)")
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (default: scripts/build_llama_server.sh builds or finds it)")
    p.add_argument("--llama-cache", default=None, help="build_llama_server.sh's cache folder")
    p.add_argument("--result-file", default=None, help="append one JSON line per engine run to this file")


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag that is out of range (reported as a usage error)."""
    for name in ("threads", "repeats", "num_requests", "single_in", "single_out", "llama_parallel", "llama_ctx"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    args.engine_specs = [parse_engine(e) for e in (args.engine or default_engines())]
    names = [e["name"] for e in args.engine_specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--engine: names must differ, got {names}")


def main(args: argparse.Namespace) -> None:
    import torch  # noqa: F401 - imported here so that every results line records its version
    engines = args.engine_specs             # check_args made them
    needs_peer = any(e["kind"] == "llama" for e in engines)
    cfg = {"gguf": args.gguf or default_gguf(), "threads": args.threads, "num_requests": args.num_requests,
           "max_tokens": args.max_tokens, "single_in": args.single_in, "single_out": args.single_out,
           "llama_parallel": args.llama_parallel, "llama_ctx": args.llama_ctx,
           "llama_server": (args.llama_server or find_llama_server(args.llama_cache)) if needs_peer else None}
    peer_version = llama_version(cfg["llama_server"]) if needs_peer else "not run"
    runs: list[list[dict[str, Any]]] = []
    for rep in range(args.repeats):
        results = []
        for engine in engines:
            results.append(run_engine(engine, cfg))
            record = {**run_metadata("cpu_peer", engine["name"], getattr(args, "command_line", None)),
                      "run": rep + 1, "engine_options": engine["options"], "llama_server_version": peer_version,
                      **cfg, **results[-1]}
            print(json.dumps(record), flush=True)
            if args.result_file:
                append_result(args.result_file, record)
        runs.append(results)
    print(format_report(cfg, engines, runs, peer_version))
