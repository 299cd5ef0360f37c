"""PNG plots of results lines: serving latency against request throughput, offline throughput against batch.

Lines come from the results file (so two engines benched one after the other share a plot) or, without one,
from the run that just ended. A label's latest line for a rate (or a batch size) stands for it: a rerun
replaces its point, while the file keeps the history. matplotlib draws with its file-only backend (Agg).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from pagedserve.frontend.bench import require
from pagedserve.frontend.bench.results import read_results

# Panels of the serving plot: (title, metric); p50 solid, p99 dashed, per label.
_SERVE_PANELS = (("TTFT", "ttft"), ("ITL", "itl"), ("E2EL", "e2el"))


def _latest(records: list[dict[str, Any]], bench: str, key: str) -> dict[str, list[dict[str, Any]]]:
    """label -> its latest record per value of `key`, sorted by that value."""
    chosen: dict[str, dict[Any, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        if r.get("bench") == bench:
            chosen[r["label"]][str(r.get(key))] = r        # later lines win
    return {label: sorted(by_key.values(), key=lambda r: _as_number(r.get(key)))
            for label, by_key in chosen.items()}


def _as_number(value: Any) -> float:
    return float(value) if value is not None else 0.0        # "inf" parses as float inf


def _records(result_file: str | None, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return read_results(result_file) if result_file else fresh


def _figure(ncols: int) -> tuple[Any, Any]:
    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 4.2), squeeze=False)
    return fig, axes[0]


def _save(fig: Any, path: str, title: str) -> None:
    import matplotlib.pyplot as plt
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def plot_serve(path: str, result_file: str | None, fresh: list[dict[str, Any]]) -> None:
    """TTFT, ITL and E2EL (p50 and p99 where recorded, else median) against achieved requests per second."""
    series = _latest(_records(result_file, fresh), "serve", "request_rate")
    fig, axes = _figure(len(_SERVE_PANELS))
    for ax, (title, metric) in zip(axes, _SERVE_PANELS):
        for i, (label, runs) in enumerate(sorted(series.items())):
            color = f"C{i}"
            x = [r["request_throughput"] for r in runs]
            middle = f"p50_{metric}_ms" if all(f"p50_{metric}_ms" in r for r in runs) else f"median_{metric}_ms"
            for key, style in ((middle, "-"), (f"p99_{metric}_ms", "--")):
                if all(key in r for r in runs):
                    name = key.split("_")[0]
                    ax.plot(x, [r[key] for r in runs], style, marker="o", color=color, label=f"{label} {name}")
        ax.set_title(title)
        ax.set_xlabel("request throughput (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    _save(fig, path, "bench serve: latency against load")


def plot_batch(path: str, result_file: str | None, fresh: list[dict[str, Any]]) -> None:
    """Output tokens per second and decode ms per token against batch size (bench latency lines)."""
    series = _latest(_records(result_file, fresh), "latency", "batch_size")
    fig, axes = _figure(2)
    panels = (("output tok/s", "output_tokens_per_second"), ("decode ms per token", "decode_ms_per_tok"))
    for ax, (title, key) in zip(axes, panels):
        for i, (label, runs) in enumerate(sorted(series.items())):
            runs = [r for r in runs if r.get(key) is not None]
            ax.plot([r["batch_size"] for r in runs], [r[key] for r in runs], "-", marker="o", color=f"C{i}",
                    label=label)
        batches = sorted({r["batch_size"] for runs in series.values() for r in runs})
        ax.set_title(title)
        ax.set_xlabel("batch size")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    _save(fig, path, "bench latency: throughput against batch")
