"""The model ladder of scripts/bench_cpu_ladder.py (issue 25): SmolLM2-shaped Llama models with random weights,
written as HF folders, converted to bf16 GGUF by llama.cpp's own convert_hf_to_gguf.py and quantized by its
llama-quantize, so both engines read files made exactly as a user's would be. Also the machine's read
bandwidth and a file's weight bytes, which give the decode floor the benchmark compares against, the
per-size workloads and their SIZE=VALUE flags, and the report (markdown tables, the plot) drawn from the
results lines, so the report can be redrawn from a results file alone.

Files: CACHE/SIZE/hf/ -> CACHE/SIZE/SIZE-bf16.gguf -> CACHE/SIZE/SIZE-FMT.gguf. A step whose output exists
is skipped; every output is written under a temporary name and renamed when complete, so an interrupted
build is redone rather than trusted. The HF folder is deleted once its bf16 GGUF exists (disk).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

# SmolLM2's shapes (HF config.json of SmolLM2-135M/360M/1.7B); `tiny` is for smoke checks only.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512),
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536),
    "360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                 intermediate_size=2560),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=8192),
}
DEFAULT_SIZES = ("135m", "360m", "1.7b")
# Shared by every size, as in SmolLM2's configs.
COMMON: dict[str, Any] = dict(vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                              max_position_embeddings=8192, initializer_range=0.02, bos_token_id=1, eos_token_id=2)
# llama-quantize type names this benchmark accepts (pagedserve's loader decodes what they produce).
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K")
DEFAULT_FORMATS = ("Q4_0", "Q8_0", "Q4_K_M")

GIB = 2**30


def gguf_path(cache: str, size: str, fmt: str) -> str:
    return os.path.join(cache, size, f"{size}-{fmt}.gguf")


def _log(msg: str) -> None:
    print(f"bench_cpu_ladder: {msg}", file=sys.stderr, flush=True)


def make_hf(folder: str, size: str) -> None:
    """The random-weight bf16 HF folder of `size` (seed 0), with SmolLM2's tokenizer."""
    import torch

    from pagedserve.tests.helpers.tiny_models import make_tiny_model
    part = folder + ".part"
    shutil.rmtree(part, ignore_errors=True)
    make_tiny_model(part, arch="llama", tokenizer="embedded", dtype=torch.bfloat16, seed=0,
                    **COMMON, **SIZES[size])
    os.replace(part, folder)


def llama_tools(llama_server: str) -> tuple[str, str]:
    """(llama-quantize, llama.cpp's source folder) of build_llama_server.sh's build whose llama-server this is:
    the quantizer lies beside it and the converter in the sources the binaries were built from."""
    bin_dir = os.path.dirname(llama_server)
    return os.path.join(bin_dir, "llama-quantize"), os.path.join(bin_dir, "..", "..", "src")


def convert_bf16(src: str, hf: str, out: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py from the same sources as the binaries (src: their CACHE/src)."""
    part = out + ".part"
    env = {**os.environ, "PYTHONPATH": os.path.join(src, "gguf-py")}
    cmd = [sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), hf, "--outtype", "bf16", "--outfile", part]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode or not os.path.isfile(part):
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    os.replace(part, out)


def quantize(binary: str, src: str, out: str, fmt: str, threads: int) -> None:
    part = out + ".part"
    proc = subprocess.run([binary, src, part, fmt, str(threads)], capture_output=True, text=True)
    if proc.returncode or not os.path.isfile(part):
        raise RuntimeError(f"llama-quantize {fmt} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    os.replace(part, out)


def build(cache: str, size: str, formats: list[str], quantize_bin: str, llama_src: str, threads: int) -> dict[str, str]:
    """Makes what is missing of `size`'s files; {format: path}."""
    folder = os.path.join(cache, size)
    os.makedirs(folder, exist_ok=True)
    bf16 = gguf_path(cache, size, "bf16")
    wanted = {fmt: gguf_path(cache, size, fmt) for fmt in formats}
    if not os.path.isfile(bf16) and not all(os.path.isfile(p) for p in wanted.values()):
        hf = os.path.join(folder, "hf")
        if not os.path.isdir(hf):
            _timed(f"{size}: random HF weights", make_hf, hf, size)
        _timed(f"{size}: bf16 GGUF", convert_bf16, llama_src, hf, bf16)
    if os.path.isfile(bf16):
        shutil.rmtree(os.path.join(folder, "hf"), ignore_errors=True)
    for fmt, path in wanted.items():
        if not os.path.isfile(path):
            _timed(f"{size}: {fmt}", quantize, quantize_bin, bf16, path, fmt, threads)
    return wanted


def _timed(what: str, fn: Any, *args: Any) -> None:
    start = time.perf_counter()
    fn(*args)
    _log(f"built {what} in {time.perf_counter() - start:.0f} s")


def gguf_weight_bytes(path: str) -> int:
    """Bytes of every tensor as stored (quantized blocks included): what one decode step reads at least,
    since the tied embedding doubles as the output projection that every step reads whole."""
    from gguf import GGUFReader
    return int(sum(int(t.n_bytes) for t in GGUFReader(path).tensors))


def gguf_tensor_types(path: str) -> dict[str, int]:
    """How many tensors of each stored type (llama-quantize falls back for widths it cannot block)."""
    from gguf import GGUFReader
    counts: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


# Timed in its own process so OMP_NUM_THREADS applies, as it does to the pagedserve child.
_BANDWIDTH_CODE = """
import json, time, torch
x = torch.rand(2**28, dtype=torch.float32)      # distinct pages: a constant fill could be deduplicated
best = float("inf")
for _ in range(5):
    start = time.perf_counter()
    x.sum()
    best = min(best, time.perf_counter() - start)
print(json.dumps({"bytes": x.numel() * 4, "seconds": best, "threads": torch.get_num_threads()}))
"""


def measure_bandwidth(threads: int) -> dict[str, float]:
    """Read bandwidth in GiB/s: 1 GiB of float32 summed, best of 5, on `threads` threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", _BANDWIDTH_CODE], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"bandwidth probe failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"bandwidth_gib_s": out["bytes"] / GIB / out["seconds"], "bandwidth_threads": out["threads"]}


def bound_ms(weight_bytes: int, bandwidth_gib_s: float) -> float:
    """The decode floor: ms to read every weight once at the measured bandwidth."""
    return weight_bytes / (bandwidth_gib_s * GIB) * 1e3


def bound_fraction(bound: float, s1_ms: float) -> float | None:
    """Share of the floor an engine reaches (1.0: at the floor); None for a time that is not positive."""
    return bound / s1_ms if s1_ms > 0 else None


# Per-size workloads: W1 requests offline, and bench serve's prompts and rates (slower models get fewer
# requests and lower rates, so every run ends in minutes and the server is not simply saturated).
NUM_REQUESTS = {"tiny": 4, "135m": 64, "360m": 64, "1.7b": 16}
SERVE_PROMPTS = {"tiny": 4, "135m": 32, "360m": 32, "1.7b": 8}
RATES = {"tiny": (2.0, 4.0), "135m": (0.5, 2.0), "360m": (0.25, 1.0), "1.7b": (0.05, 0.2)}


def parse_size_map(items: list[str], parse: Any, flag: str) -> dict[str, Any]:
    """["SIZE=VALUE", ...] -> {size: parse(VALUE)}; ValueError naming the flag and the bad item."""
    out: dict[str, Any] = {}
    for item in items:
        size, eq, value = item.partition("=")
        if not eq or size not in SIZES:
            raise ValueError(f"{flag}: {item!r} is not SIZE=VALUE with SIZE one of {', '.join(SIZES)}")
        try:
            out[size] = parse(value)
        except ValueError as exc:
            raise ValueError(f"{flag}: {item!r}: {exc}") from None
    return out


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is not >= 1")
    return value


def rates(text: str) -> tuple[float, ...]:
    """"0.5,2" -> (0.5, 2.0); inf is allowed (every request at once), zero or less is not."""
    values = tuple(float(r) for r in text.split(",") if r.strip())
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"rates must be > 0, got {text!r}")
    return values


# The report: tables and a plot of the ladder's results lines (bench "cpu_ladder" and bench serve's "serve").
PEER = "llama.cpp"
_KEYS = ("ms_per_token", "own_ms_per_token", "bound_fraction", "prefill_tok_s", "w1_tok_s", "peak_rss_mib",
         "bandwidth_gib_s")


def _groups(records: list[dict]) -> dict[tuple[str, str], dict[str, list[dict]]]:
    """(size, format) -> engine -> its runs, in the order they ran."""
    groups: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for r in records:
        if r.get("bench") == "cpu_ladder" and "engine" in r:
            groups.setdefault((r["size"], r["format"]), {}).setdefault(r["engine"], []).append(r)
    return groups


def _medians(runs: list[dict]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in _KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def _ratio(value: float | None, peer: float | None) -> str:
    return f"{value / peer:.2f}x" if value is not None and peer else "-"


def format_tables(records: list[dict]) -> str:
    """One markdown table per size and format: medians over repeats, ratios engine / llama.cpp."""
    out: list[str] = []
    for (size, fmt), by_engine in _groups(records).items():
        first = next(iter(by_engine.values()))[0]
        runs = max(len(v) for v in by_engine.values())
        out += [f"\n### {size} {fmt}: {first['gguf_weight_bytes'] / 2**20:.1f} MiB of weights; {first['threads']} "
                f"threads; W1 n={first['num_requests']}" + (f"; medians of {runs} runs" if runs > 1 else "") +
                "; bound fraction: the weights read at the bandwidth probed just before that engine's run\n",
                ("| engine | S1 ms/token | vs llama.cpp | read GiB/s | bound fraction | prefill tok/s | vs llama.cpp | "
                 "W1 tok/s | vs llama.cpp | peak RSS MiB |"), "|---|---|---|---|---|---|---|---|---|---|"]
        peer = _medians([r for r in by_engine.get(PEER, []) if "error" not in r])
        for engine, engine_runs in by_engine.items():
            ok = [r for r in engine_runs if "error" not in r]
            if not ok:
                out.append(f"| {engine} | failed: {engine_runs[-1]['error'].splitlines()[0][:120]} "
                           "| | | | | | | | |")
                continue
            m = _medians(ok)
            own = f" (own {m['own_ms_per_token']:.2f})" if m["own_ms_per_token"] is not None else ""
            frac = f"{m['bound_fraction']:.2f}" if m["bound_fraction"] is not None else "-"
            bw = f"{m['bandwidth_gib_s']:.1f}" if m["bandwidth_gib_s"] is not None else "-"
            out.append(f"| {engine} | {m['ms_per_token']:.2f}{own} | {_ratio(m['ms_per_token'], peer['ms_per_token'])} "
                       f"| {bw} | {frac} | {m['prefill_tok_s']:.0f} | {_ratio(m['prefill_tok_s'], peer['prefill_tok_s'])} "
                       f"| {m['w1_tok_s']:.1f} | {_ratio(m['w1_tok_s'], peer['w1_tok_s'])} | {m['peak_rss_mib']:.0f} |")
    return "\n".join(out)


def format_serve_tables(records: list[dict]) -> str:
    rows = [r for r in records if r.get("bench") == "serve"]
    if not rows:
        return ""
    out = ["\n### Serving: bench serve, W1 with --ignore-eos, one server at a time\n",
           "| label | rate req/s | done/failed | req/s | output tok/s | p50 TTFT ms | p99 TTFT ms | p50 TPOT ms |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['label']} | {float(r['request_rate']):g} | {r['completed']}/{r['failed']} | "
                   f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {r.get('p50_ttft_ms', 0):.0f} | "
                   f"{r.get('p99_ttft_ms', 0):.0f} | {r.get('p50_tpot_ms', 0):.1f} |")
    return "\n".join(out)


def latest_points(records: list[dict]) -> dict[tuple[str, str], list[tuple[float, str, float, float]]]:
    """(engine, format) -> [(weight MiB, size, S1 ms/token, W1 tok/s)] by weight: per file, the medians of
    the latest ladder run that measured it (a rerun replaces its points; the file keeps the history)."""
    latest: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        if r.get("bench") != "cpu_ladder" or "error" in r or "engine" not in r:
            continue
        key = (r["engine"], r["format"], r["size"])
        kept = latest.get(key, [])
        if not kept or r["ladder_run"] > kept[0]["ladder_run"]:
            latest[key] = [r]
        elif r["ladder_run"] == kept[0]["ladder_run"]:
            kept.append(r)
    series: dict[tuple[str, str], list[tuple[float, str, float, float]]] = {}
    for (engine, fmt, size), runs in latest.items():
        m = _medians(runs)
        series.setdefault((engine, fmt), []).append(
            (runs[0]["gguf_weight_bytes"] / 2**20, size, m["ms_per_token"], m["w1_tok_s"]))
    return {k: sorted(v) for k, v in series.items()}


def plot_ladder(path: str, records: list[dict]) -> None:
    """Two panels against weight MiB (log-log): S1 ms/token and W1 output tok/s; colour = format,
    solid = llama.cpp, dashed = pagedserve (any other engine dotted)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker
    series = latest_points(records)
    formats = sorted({fmt for _, fmt in series})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for (engine, fmt), points in sorted(series.items()):
        style, marker = {PEER: ("-", "o"), "pagedserve": ("--", "s")}.get(engine, (":", "^"))
        xs = [p[0] for p in points]
        for ax, column in zip(axes, (2, 3)):
            ax.plot(xs, [p[column] for p in points], style, marker=marker, color=f"C{formats.index(fmt)}",
                    label=f"{engine} {fmt}")
        if engine == PEER:
            for x, size, s1, _ in points:
                axes[0].annotate(size, (x, s1), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for ax, title in zip(axes, ("S1 decode ms/token (lower is better)", "W1 output tok/s (higher is better)")):
        ax.set_title(title)
        ax.set_xlabel("GGUF weight MiB")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            # Plain numbers at 1-2-5 steps: the default 10^x labels say little over one or two decades.
            axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_locator(ticker.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("CPU ladder: llama.cpp and pagedserve on SmolLM2-shaped models")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
