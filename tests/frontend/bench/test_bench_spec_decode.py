"""`pagedserve bench spec-decode`'s engines (frontend/bench/peer/spec_decode.py): the speculative one is labelled
by its method, and llama.cpp gets the same draft model where pagedserve runs a GGUF draft (pure functions; nothing
is run)."""
from __future__ import annotations

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

