"""`pagedserve bench spec-decode`'s engines (frontend/bench/peer/spec_decode.py): the speculative one is labelled
by its method, and llama.cpp gets the same draft model where pagedserve runs a GGUF draft (pure functions; nothing
is run); --spec is checked before anything starts, and --help comes through the real CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.frontend import pagedserve_cli
from pagedserve.frontend.bench.peer import spec_decode as bench


def test_ngram_keeps_its_label_and_llama_cpp_ngram_types():
    names = bench.engine_names(bench.DEFAULT_SPEC, None)
    assert names == ["pagedserve", "pagedserve-ngram", "llama.cpp"] + [f"llama.cpp-{t}" for t in bench.LLAMA_SPEC_TYPES]
    assert bench.llama_draft_args(bench.DEFAULT_SPEC) is None


def test_a_gguf_draft_model_is_labelled_and_given_to_llama_cpp():
    spec = {"model": "/m/draft.gguf", "num_speculative_tokens": 3}        # method implied by the model
    assert bench.engine_names(spec, None) == ["pagedserve", "pagedserve-draft_model", "llama.cpp", "llama.cpp-draft"]
    assert bench.llama_draft_args(spec) == ("--spec-type", "draft-simple", "--spec-draft-model", "/m/draft.gguf",
                                            "--spec-draft-n-max", "3")
    assert bench.engine_names(spec, ["ngram-mod"])[-2:] == ["llama.cpp-ngram-mod", "llama.cpp-draft"]


def test_an_hf_draft_has_no_llama_cpp_peer():
    spec = {"method": "draft_model", "model": "/m/draft-folder", "num_speculative_tokens": 2}
    assert bench.engine_names(spec, None) == ["pagedserve", "pagedserve-draft_model", "llama.cpp"]


def test_help_is_the_benchmarks_own():
    proc = subprocess.run([sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", "bench", "spec-decode",
                           "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "speculative decoding on CPU (issue 26)" in proc.stdout
    assert "pagedserve bench spec-decode --repeats 2" in proc.stdout
    for flag in ("--gguf", "--spec", "--llama-spec-types", "--w1-requests", "--result-file"):
        assert flag in proc.stdout


def test_spec_is_parsed_before_the_run(capsys):
    args = pagedserve_cli.parse_args(["bench", "spec-decode"])
    assert args.spec_config == bench.DEFAULT_SPEC and args.run is bench.main
    spec = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    assert pagedserve_cli.parse_args(["bench", "spec-decode", "--spec", spec]).spec_config["num_speculative_tokens"] == 8
    for bad, message in (('{"method": "medusa2"}', "method must be one of"), ("{not json", "--spec: "),
                         ("{}", "no speculation")):
        with pytest.raises(SystemExit) as exit_:
            pagedserve_cli.parse_args(["bench", "spec-decode", "--spec", bad])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
