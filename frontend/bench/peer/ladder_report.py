"""The report of `pagedserve bench ladder`: markdown tables and a plot drawn from the results lines alone (bench
"cpu_ladder" and bench serve's "serve"), so a report can be redrawn from a results file (plot_ladder)."""
from __future__ import annotations

import statistics

from pagedserve.frontend.bench.peer.engines import PEER

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
