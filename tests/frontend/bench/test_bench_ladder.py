"""`pagedserve bench ladder` (frontend/bench/peer/ladder*.py): SIZE=VALUE flags through the real CLI parser, the
bandwidth floor's arithmetic, pagedserve's options as serve flags, and the report's tables and plot points (pure
functions; nothing is built or run)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pagedserve.frontend import pagedserve_cli
from pagedserve.frontend.bench.peer import ladder, ladder_report
from pagedserve.frontend.bench.peer import ladder_models as lm
from pagedserve.frontend.bench.peer.ladder_serve import serve_flags


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`pagedserve bench ladder ARGV` as the CLI parses and checks it."""
    return pagedserve_cli.parse_args(["bench", "ladder", *argv])


def test_size_overrides_keep_the_other_sizes_defaults():
    args = parse_args(["--num-requests", "360m=8", "tiny=3", "--rates", "1.7b=0.1,inf",
                       "--serve-prompts", "135m=5"])
    assert args.num_requests == {"tiny": 3, "135m": 64, "360m": 8, "1.7b": 16}
    assert args.rates["1.7b"] == (0.1, float("inf"))
    assert args.rates["135m"] == (0.5, 2.0)
    assert args.serve_prompts == {"tiny": 4, "135m": 5, "360m": 32, "1.7b": 8}
    assert args.sizes == ["135m", "360m", "1.7b"] and args.formats == ["Q4_0", "Q8_0", "Q4_K_M"]
    assert args.engine == ["llama.cpp", "pagedserve"] and args.serve and args.pagedserve_options == {}


def test_repeated_flags_add_up_and_the_last_value_wins():
    args = parse_args(["--num-requests", "tiny=3", "--num-requests", "135m=7", "tiny=9"])
    assert args.num_requests["tiny"] == 9 and args.num_requests["135m"] == 7


@pytest.mark.parametrize("item, parse, problem", [
    ("7b=4", "positive_int", "7b=4"),            # not a ladder size
    ("tiny", "positive_int", "SIZE=VALUE"),
    ("tiny=0", "positive_int", ">= 1"),
    ("tiny=four", "positive_int", "four"),
    ("tiny=0.5,0", "rates", "> 0"),
    ("tiny=", "rates", "> 0"),
])
def test_bad_size_maps_name_the_problem(item, parse, problem):
    with pytest.raises(ValueError, match=problem) as err:
        lm.parse_size_map([item], getattr(lm, parse), "--flag")
    assert "--flag" in str(err.value)


def test_serve_only_needs_serving(capsys):
    assert parse_args(["--serve-only"]).serve_only
    with pytest.raises(SystemExit):
        parse_args(["--serve-only", "--no-serve"])
    assert "leave nothing to run" in capsys.readouterr().err


def test_pagedserve_options_are_typed_and_prefix_caching_stays_off(capsys):
    args = parse_args(["--pagedserve-option", "max_num_seqs=32", "--pagedserve-option", "quantization=int8"])
    assert args.pagedserve_options == {"max_num_seqs": 32, "quantization": "int8"}
    with pytest.raises(SystemExit):
        parse_args(["--pagedserve-option", "enable_prefix_caching=true"])
    assert "prefix caching stays off" in capsys.readouterr().err


def test_serve_flags_spell_bools_as_the_server_does():
    flags = serve_flags({"max_num_seqs": 4, "enable_prefix_caching": False, "enforce_eager": True,
                         "max_model_len": None})
    assert flags == ["--max-num-seqs", "4", "--no-enable-prefix-caching", "--enforce-eager"]
    assert serve_flags({"enforce_eager": False, "enable_prefix_caching": True}) == ["--enable-prefix-caching"]


def test_the_floor_is_the_weights_read_once():
    # 1.5 GiB at 12 GiB/s: 125 ms; an engine at 250 ms/token reaches half the floor.
    assert lm.bound_ms(3 * 2**29, 12.0) == pytest.approx(125.0)
    assert lm.bound_fraction(125.0, 250.0) == pytest.approx(0.5)
    assert lm.bound_fraction(125.0, 0.0) is None          # noise can make a tiny model's S1 <= 0


def _line(engine: str, ms: float, w1: float, prefill: float = 1000.0, run: str = "2026-01-01T00:00:00",
          **extra) -> dict:
    return {"bench": "cpu_ladder", "ladder_run": run, "engine": engine, "size": "135m", "format": "Q4_0",
            "gguf_weight_bytes": 80 * 2**20, "bound_ms": 4.0, "bandwidth_gib_s": 20.0, "threads": 2,
            "num_requests": 64, "ms_per_token": ms, "bound_fraction": 4.0 / ms, "prefill_tok_s": prefill,
            "w1_tok_s": w1, "peak_rss_mib": 500.0, **extra}


def test_table_takes_medians_and_ratios_to_llama_cpp():
    records = [_line("llama.cpp", 8.0, 100.0, own_ms_per_token=7.5), _line("pagedserve", 5.0, 250.0, 500.0),
               _line("pagedserve", 4.0, 300.0, 400.0), _line("llama.cpp", 8.0, 100.0, own_ms_per_token=7.5),
               _line("pagedserve", 6.0, 200.0, 600.0),
               {"bench": "serve", "label": "llama.cpp 135m Q4_0"}]            # not a ladder line: not a row
    text = ladder_report.format_tables(records)
    assert "### 135m Q4_0: 80.0 MiB of weights; 2 threads; W1 n=64; medians of 3 runs" in text
    rows = [line for line in text.splitlines() if line.startswith("| llama.cpp") or line.startswith("| pagedserve")]
    assert rows[0] == "| llama.cpp | 8.00 (own 7.50) | 1.00x | 20.0 | 0.50 | 1000 | 1.00x | 100.0 | 1.00x | 500 |"
    assert rows[1] == "| pagedserve | 5.00 | 0.62x | 20.0 | 0.80 | 500 | 0.50x | 250.0 | 2.50x | 500 |"


def test_a_failed_engine_is_a_row_and_its_peer_still_shows():
    metrics = ("ms_per_token", "bound_fraction", "prefill_tok_s", "w1_tok_s", "peak_rss_mib")
    failed = {k: v for k, v in _line("pagedserve", 1.0, 1.0).items() if k not in metrics}  # as measure() writes it
    records = [_line("llama.cpp", 8.0, 100.0),
               {**failed, "error": "RuntimeError: pagedserve failed (exit 1):\ntraceback"}]
    rows = ladder_report.format_tables(records).splitlines()
    assert "| pagedserve | failed: RuntimeError: pagedserve failed (exit 1): | | | | | | | | |" in rows
    assert any(r.startswith("| llama.cpp | 8.00 | 1.00x") for r in rows)


def test_plot_points_come_from_each_files_latest_run():
    records = [_line("pagedserve", 9.0, 50.0, run="2026-01-01T00:00:00"),
               _line("pagedserve", 5.0, 250.0, run="2026-02-01T00:00:00"),
               _line("pagedserve", 7.0, 150.0, run="2026-02-01T00:00:00"),
               {**_line("pagedserve", 1.0, 1.0, run="2026-03-01T00:00:00"), "error": "failed"},
               {**_line("llama.cpp", 8.0, 100.0), "size": "360m", "gguf_weight_bytes": 200 * 2**20}]
    points = ladder_report.latest_points(records)
    assert points[("pagedserve", "Q4_0")] == [(80.0, "135m", 6.0, 200.0)]
    assert points[("llama.cpp", "Q4_0")] == [(200.0, "360m", 8.0, 100.0)]


def test_help_is_the_benchmarks_own():
    proc = subprocess.run([sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", "bench", "ladder", "--help"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "CPU speed at real model sizes (issue 25)" in proc.stdout
    assert "pagedserve bench ladder --build-only" in proc.stdout
    for flag in ("--sizes", "--formats", "--serve-only", "--pagedserve-option", "--plot", "--build-only"):
        assert flag in proc.stdout


def test_out_of_range_counts_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--repeats", "0"])
    assert exit_.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err
    assert parse_args([]).run is ladder.main
