"""CPU speed at real model sizes (issue 25): llama.cpp's llama-server and pagedserve on a ladder of
SmolLM2-shaped Llama models (135m, 360m, 1.7b; random weights) in Q4_0, Q8_0 and Q4_K_M, each file made by
llama.cpp's own converter and llama-quantize (scripts/ladder_models.py; cached, built once).

Per file, both engines on THREADS threads each (pagedserve in its own process with OMP_NUM_THREADS, llama-server
with -t), alternating (the order flips every repeat, so a drifting machine costs both alike):
  S1       single-stream decode ms/token: 128 prompt ids, (t(n+1 tokens) - t(1 token)) / n, n = --single-out
           (scripts/bench_cpu_peer.py's measure); llama-server also reports its own
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

    .venv/bin/python scripts/bench_cpu_ladder.py --repeats 1 --result-file benchmarks/results/cpu_ladder.jsonl \\
        --plot benchmarks/results/cpu_ladder.png                                 # the full ladder
    .venv/bin/python scripts/bench_cpu_ladder.py --build-only                    # the model files only
    .venv/bin/python scripts/bench_cpu_ladder.py --sizes tiny --formats Q4_0 Q8_0 --num-requests tiny=4 \\
        --rates tiny=2,4 --single-out 16 --result-file /tmp/ladder_smoke.jsonl --plot /tmp/ladder_smoke.png
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import ladder_models as lm  # scripts/ is on sys.path when a script runs
from bench_child import report, run_child
from bench_cpu_peer import PEER, decode_ms, engine_args_overrides, find_llama_server, single_prompt, w1_requests
from llama_server_peer import LlamaServer, free_port, version as llama_version

from pagedserve.frontend.bench.results import append_result, read_results, run_metadata

ENGINES = (PEER, "pagedserve")
LLAMA_PARALLEL, LLAMA_CTX = 16, 12800        # as bench_cpu_peer and benchmarks/README.md's serve runs
PREFILL_LEN = 512
BIN = os.path.dirname(sys.executable)


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


def run_llama(cfg: dict) -> dict:
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
    """pagedserve's measurements, in a process of their own so OMP_NUM_THREADS and ru_maxrss are its alone."""
    import torch
    from pagedserve import LLM, SamplingParams
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


def run_pagedserve(cfg: dict) -> dict:
    return run_child(__file__, json.dumps(cfg), cfg["threads"], "pagedserve")


def measure(engine: str, cfg: dict, bound: float) -> dict:
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


def serve_flags(options: dict) -> list[str]:
    """EngineArgs overrides as `pagedserve serve` flags (bools as --x / --no-x); an unset (None) is left to
    the server's default, which is what unset means there too."""
    from pagedserve.common.config.arg_utils import add_dataclass_args
    from pagedserve.common.config.engine_args import EngineArgs
    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_args(parser, EngineArgs)
    actions = {a.dest: a for a in parser._actions}
    flags: list[str] = []
    for key, value in options.items():
        flag = actions[key].option_strings[0]
        if isinstance(value, bool):
            if value or isinstance(actions[key], argparse.BooleanOptionalAction):
                flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


@contextlib.contextmanager
def pagedserve_server(gguf: str, threads: int, options: dict, timeout_s: float = 900.0) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [os.path.join(BIN, "pagedserve"), "serve", gguf, "--host", "127.0.0.1", "--port", str(port),
           *serve_flags(options)]
    with tempfile.TemporaryFile("w+") as log:
        # A session of its own: its engine core child can be found (and stopped) by the group id.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        try:
            wait_health(url, proc, timeout_s, log)
            yield url
        finally:
            stop_group(proc)


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float, log: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"pagedserve serve exited with {proc.returncode}:\n{log.read()[-4000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"pagedserve serve not healthy after {timeout_s:.0f} s")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server (it stops its engine core), then, after a grace period, whatever is left of the
    process group it leads (only processes it started), so the next server has the cores to itself."""
    import signal
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    with contextlib.suppress(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)                  # raises once the group is empty
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def serving(engine: str, cfg: dict) -> Iterator[str]:
    if engine != PEER:
        with pagedserve_server(cfg["gguf"], cfg["threads"], cfg["user_options"]) as url:
            yield url
        return
    server = LlamaServer(cfg["llama_server"], cfg["gguf"], cfg["threads"], LLAMA_PARALLEL, LLAMA_CTX)
    try:
        yield server.url
    finally:
        server.stop()


def bench_serve(url: str, label: str, num_prompts: int, rates: tuple[float, ...]) -> list[dict]:
    """`pagedserve bench serve` on one server; its lines, read back from a file of their own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "serve.jsonl")
        cmd = [os.path.join(BIN, "pagedserve"), "bench", "serve", "--base-url", url, "--label", label,
               "--dataset-name", "w1", "--num-prompts", str(num_prompts), "--request-rate",
               *(str(r) for r in rates), "--ignore-eos", "--result-file", out]
        proc = subprocess.run(cmd, stdout=sys.stderr)       # its reports go with the progress lines
        if proc.returncode or not os.path.isfile(out):
            raise RuntimeError(f"bench serve against {label} failed (exit {proc.returncode})")
        return read_results(out)


def serve_size(args: argparse.Namespace, size: str, info: dict, cfg: dict, emit: Callable[[dict], None]) -> None:
    """Each rate against a fresh server: W1's prompts are the same at every rate, and a server that served them
    at the first would answer the second from its prefix cache (pagedserve) or its slots' cached prompts
    (llama-server's cache_prompt)."""
    for engine in args.engine:
        label = f"{engine} {size} {info['format']}"
        for rate in args.rates[size]:
            try:
                with serving(engine, cfg) as url:
                    lines = bench_serve(url, label, args.serve_prompts[size], (rate,))
            except Exception as exc:     # noqa: BLE001 - the offline numbers of the ladder still stand
                print(f"bench_cpu_ladder: serving {label} at {rate}/s failed: {exc}", file=sys.stderr, flush=True)
                continue
            for line in lines:
                emit({**line, **info, "engine": engine, "threads": cfg["threads"]})


def file_info(base: dict, size: str, fmt: str, path: str) -> dict:
    weight_bytes = lm.gguf_weight_bytes(path)
    return {**base, "size": size, "format": fmt, "gguf": path, "gguf_weight_bytes": weight_bytes,
            "gguf_tensor_types": lm.gguf_tensor_types(path),
            "bound_ms": lm.bound_ms(weight_bytes, base["bandwidth_gib_s"])}


def run_ladder(args: argparse.Namespace, files: dict, llama_server: str) -> list[dict]:
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        if args.result_file:
            append_result(args.result_file, record)

    import torch  # noqa: F401 - imported so that run_metadata records its version
    base = {"ladder_run": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "threads": args.threads, "llama_server_version": llama_version(llama_server),
            **lm.measure_bandwidth(args.threads)}
    progress(f"read bandwidth {base['bandwidth_gib_s']:.2f} GiB/s on {args.threads} threads")
    options = {"enable_prefix_caching": False, **args.pagedserve_options}
    for size in args.sizes:
        for fmt in () if args.serve_only else args.formats:
            info = file_info(base, size, fmt, files[size][fmt])
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
                    emit({**run_metadata("cpu_ladder", f"{engine} {size} {fmt}"), **info, **bw, "bound_ms": bound,
                          "run": rep + 1,
                          "engine": engine, "engine_options": options if engine != PEER else {},
                          **{k: cfg[k] for k in ("num_requests", "single_in", "single_out", "prefill_len")}, **r})
        if args.serve:
            fmt = args.serve_format
            info = file_info(base, size, fmt, files[size][fmt])
            cfg = {"gguf": info["gguf"], "threads": args.threads, "llama_server": llama_server,
                   "user_options": args.pagedserve_options}
            serve_size(args, size, info, cfg, emit)
    return records


def progress(msg: str) -> None:
    print(f"bench_cpu_ladder: {msg}", file=sys.stderr, flush=True)


def summary(r: dict) -> str:
    if "error" in r:
        return "FAILED " + r["error"].splitlines()[0]
    return (f"S1 {r['ms_per_token']:.2f} ms/token, prefill {r['prefill_tok_s']:.0f} tok/s, W1 {r['w1_tok_s']:.1f} "
            f"tok/s, peak RSS {r['peak_rss_mib']:.0f} MiB ({r['wall_s']:.0f} s)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    for name in ("repeats", "threads", "single_out"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        check_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def check_args(args: argparse.Namespace) -> None:
    """Size maps filled in from the defaults, pagedserve's options typed; ValueError naming the flag."""
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
    print(lm.format_tables(records))
    print(lm.format_serve_tables(records))
    if args.plot:
        lm.plot_ladder(args.plot, read_results(args.result_file) if args.result_file else records)
        progress(f"plot written to {args.plot}")


if __name__ == "__main__":
    ns = parse_args()
    child_main(ns.child) if ns.child else main(ns)
