"""`pagedserve bench mm` (frontend/bench/mm.py, mm_http.py) on the tiny Llava: the throughput rows of both
engines and the two TTFT rows over a real `pagedserve serve` carry their fields, with positive numbers (speed
is not asserted); bad flags are usage errors; the default model shape follows the registry."""
from __future__ import annotations

import json

import pytest

from pagedserve.frontend import pagedserve_cli
from pagedserve.frontend.bench import mm, models
from pagedserve.frontend.bench.results import read_results
from pagedserve.tests.helpers.models.tiny_vlm import make_tiny_llava

SMALL = ("--image-size", "32", "--dtype", "float32", "--threads", "1", "--repeats", "1",
         "--engine-option", "kv_cache_memory=0.05", "--engine-option", "max_model_len=512")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("llava")))


def run_bench(*argv: str) -> None:
    args = pagedserve_cli.parse_args(["bench", "mm", *argv])
    args.command_line = ["pagedserve", "bench", "mm", *argv]
    args.run(args)


def positive(row: dict, *keys: str) -> None:
    for key in keys:
        assert row[key] > 0, (key, row[key])


def test_throughput_rows_of_both_engines(llava_dir, tmp_path, monkeypatch):
    # Each row in this process: the child-process path is bench peer's (tested there), and a fresh
    # interpreter per row would cost this test most of its time.
    monkeypatch.setattr(mm, "run_child", lambda module, payload, threads, what: mm.run_row(json.loads(payload)))
    out = str(tmp_path / "mm.jsonl")
    run_bench("--measure", "throughput", "--model", llava_dir, "--batch-size", "1", "2", "--num-prompts", "2",
              "--output-len", "4", *SMALL, "--result-file", out)
    rows = read_results(out)
    assert [(r["engine"], r["batch_size"]) for r in rows] == [("pagedserve", 1), ("hf", 1), ("pagedserve", 2),
                                                              ("hf", 2)]
    for row in rows:
        assert row["bench"] == "mm_throughput" and row["command"].startswith("pagedserve bench mm --measure")
        assert row["num_requests"] == 2 and row["output_tokens"] == 8 and "<image>" in row["prompt"]
        positive(row, "elapsed_time", "output_tokens_per_second", "requests_per_second", "peak_rss_mib")
    positive(rows[0], "vs_hf_output_tokens_per_second")
    positive(rows[2], "vs_hf_output_tokens_per_second")


def test_ttft_rows_over_http(llava_dir, tmp_path):
    out = str(tmp_path / "mm.jsonl")
    run_bench("--measure", "ttft-cache", "ttft-beside", "--model", llava_dir, "--ttft-output-len", "2",
              "--ttft-rounds", "2", "--idle-samples", "2", "--large-image-size", "64", "--num-large-images", "2",
              *SMALL, "--result-file", out)
    cache, beside = read_results(out)
    assert cache["bench"] == "mm_ttft_cache" and beside["bench"] == "mm_ttft_beside"
    assert len(cache["uncached_ttft_ms"]) == len(cache["cached_ttft_ms"]) == 2
    assert all(hits > 0 for hits in cache["cached_prefix_hit_tokens"])      # the same image again hit the cache
    positive(cache, "median_uncached_ttft_ms", "median_cached_ttft_ms", "cached_vs_uncached")
    assert len(beside["idle_ttft_ms"]) == 2 and len(beside["beside_ttft_ms"]) == 2
    assert len(beside["large_image_ttft_ms"]) == 4
    positive(beside, "median_idle_ttft_ms", "median_beside_ttft_ms", "beside_vs_idle", "large_body_bytes")


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--output-len", "0"], "--output-len must be >= 1"),
    (["--engine-option", "max_num_seqs"], "KEY=VALUE"),
    (["--engine-option", "no_such_field=1"], "no_such_field"),
    (["--engine-option", "dtype=float32"], "use --dtype"),
    (["--measure", "latency"], "invalid choice"),
])
def test_bad_flags_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        pagedserve_cli.parse_args(["bench", "mm", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_default_shape_is_smolvlm_once_idefics3_is_served(monkeypatch):
    from pagedserve.executor.model import models as registry
    assert models.default_vlm() == ("smolvlm-256m-shape" if models.IDEFICS3 in registry.supported_architectures()
                                    else "llava-b16-smollm2-135m")
    monkeypatch.setattr(registry, "supported_architectures", lambda: ["LlavaForConditionalGeneration",
                                                                     models.IDEFICS3])
    assert models.default_vlm() == "smolvlm-256m-shape"
