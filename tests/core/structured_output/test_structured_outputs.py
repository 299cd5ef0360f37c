"""Structured outputs offline (LLM): every sampled output obeys its JSON Schema, regex or choice, the grammar
ends generation, unconstrained neighbours are untouched, and a schema compiles once."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.common.config.engine_args import EngineArgs, StructuredOutputsConfig
from pagedserve.tests.helpers.schemas import SCHEMAS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_model_len=512, kv_cache_memory=0.25, dtype="float32")
    yield engine
    engine.shutdown()


def _so(**kw) -> SamplingParams:
    structured = kw.pop("structured")
    return SamplingParams(structured_outputs=StructuredOutputsParams(**structured), **kw)


def test_json_schemas_hold_under_sampling(llm):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for seed in (1,):
            prompts.append(f"Answer with JSON only. Example {i}:")
            params.append(_so(structured={"json": schema}, temperature=1.0, seed=seed + 10 * i, max_tokens=120))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for k, out in enumerate(outs):
        text, schema = out.outputs[0].text, SCHEMAS[k]
        assert out.outputs[0].finish_reason == "stop", (k, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_json_object(llm):
    params = [_so(structured={"regex": r"[0-9]{3}-[a-z]{2,4}"}, temperature=1.0, seed=5, max_tokens=30),
              _so(structured={"choice": ["yes", "no", "maybe so"]}, temperature=1.0, seed=6, max_tokens=30),
              _so(structured={"json_object": True, "disable_any_whitespace": True}, temperature=0.7, seed=7,
                  max_tokens=200),
              _so(structured={"grammar": 'root ::= "A" digit digit\ndigit ::= [0-9]'}, temperature=1.0, seed=8,
                  max_tokens=30)]
    outs = llm.generate(["Code:", "Answer:", "JSON object:", "Id:"], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[0])
    assert texts[1] in ("yes", "no", "maybe so")
    if outs[2].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[2]), dict)
    else:           # a free-form object may run to max_tokens; what came so far is still an object's start
        assert texts[2].startswith("{") and " " not in texts[2].split('"')[0]
    assert re.fullmatch(r"A[0-9]{2}", texts[3])
    assert all(o.outputs[0].finish_reason == "stop" for i, o in enumerate(outs) if i != 2)


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm, monkeypatch):
    plain = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["The capital of France is", "List three fruits:"]
    masks = _record_bitmasks(llm, monkeypatch)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    assert masks and all(m is None for m in masks)        # no constrained row: no bitmask field at all
    masks.clear()
    mixed_prompts = [prompts[0], "JSON:", prompts[1], "Pick:"]
    mixed = llm.generate(mixed_prompts, [plain, _so(structured={"json": SCHEMAS[0]}, temperature=0, max_tokens=60),
                                         plain, _so(structured={"choice": ["x", "y"]}, temperature=0, max_tokens=5)],
                         use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])
    # Only constrained rows ever get a bitmask row, one int32 word per 32 tokens of the model's vocabulary.
    rows = [rid for m in masks if m is not None for rid in m.req_ids]
    constrained = {mixed[1].request_id, mixed[3].request_id}
    assert rows and set(rows) <= constrained
    assert all(len(m.data) == 4 * m.num_words * len(m.req_ids) and m.num_words * 32 >= llm.info.vocab_size
               for m in masks if m is not None)


def _record_bitmasks(llm, monkeypatch) -> list:
    """The grammar_bitmask of every step the real executor runs (the call itself is unchanged)."""
    seen: list = []
    executor = llm.engine.executor
    real = executor.execute_model

    def spy(sched):
        seen.append(sched.grammar_bitmask)
        return real(sched)
    monkeypatch.setattr(executor, "execute_model", spy)
    return seen


def test_same_schema_compiles_once(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}},
              "required": ["n"], "x-test": "compile-once"}
    stats0 = _so_stats(llm)
    params = [_so(structured={"json": schema}, temperature=1.0, seed=s, max_tokens=20) for s in range(4)]
    llm.generate(["n:"] * 4, params, use_tqdm=False)
    # The same schema as text, with its keys in another order, is the same spec.
    text = json.dumps(dict(reversed(list(schema.items()))))
    llm.generate(["n:"], _so(structured={"json": text}, temperature=0, max_tokens=20), use_tqdm=False)
    stats1 = _so_stats(llm)
    assert stats1["num_compiles"] - stats0["num_compiles"] == 1


def test_offline_validation_names_the_field():
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+").validate()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[]).validate()


def test_bad_specs_fail_the_request_and_engine_keeps_serving(llm):
    bad = [{"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
           {"regex": "([a-z]"},
           {"grammar": "root ::= "}]
    for spec in bad:
        field = "structured_outputs." + next(iter(spec))
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(["x"], _so(structured=spec, max_tokens=5), use_tqdm=False)
    out = llm.generate(["Pick:"], _so(structured={"choice": ["ok"]}, max_tokens=5), use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


def _so_stats(llm) -> dict:
    return llm.client.call_utility("get_structured_output_stats")


def test_reasoning_parser_constrains_only_the_answer(tmp_path):
    """With --reasoning-parser the grammar starts after the end-of-thinking marker: a prompt that closes the
    thinking (as qwen3's template does with thinking off) is constrained from the first token; one that
    does not is left free while the model "thinks"."""
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    path = make_tiny_model(str(tmp_path / "tiny"), arch="llama", vocab_size=49152)
    with LLM(path, reasoning_parser="deepseek_r1", max_model_len=128, kv_cache_memory=0.05) as engine:
        tok = engine.get_tokenizer()
        choice = _so(structured={"choice": ["alpha", "beta"]}, temperature=0, max_tokens=12, ignore_eos=True)
        closed, open_ = (tok.encode("Q? <think>hm</think>"), tok.encode("Q? <think>hm"))
        outs = engine.generate([{"prompt_token_ids": closed}, {"prompt_token_ids": open_}], choice,
                               use_tqdm=False)
        assert outs[0].outputs[0].text in ("alpha", "beta") and outs[0].outputs[0].finish_reason == "stop"
        # A random-weight model never writes the marker: nothing constrains it, it runs to max_tokens.
        assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 12


def test_grammar_cache_is_bounded(tmp_path, monkeypatch):
    """A client sending a fresh schema per request must not grow the core: least recently used grammars go."""
    import pagedserve.core.structured_output as so
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_serving_model
    folder = make_tiny_serving_model(str(tmp_path))
    monkeypatch.setattr(so, "MAX_CACHED_GRAMMARS", 3)
    config = StructuredOutputsConfig(reasoning_parser=None,
                                     compile_timeout_s=EngineArgs.structured_outputs_compile_timeout)
    manager = so.StructuredOutputManager(lambda: folder, vocab_size=49152, stop_token_ids=[2], config=config)
    try:
        def compile_choice(word: str) -> None:
            manager.submit(StructuredOutputsParams(choice=[word])).compiled.result(timeout=120)
        for word in ("a", "b", "c", "d", "e"):
            compile_choice(word)
        assert manager.stats()["num_cached_grammars"] == 3
        compiled = manager.num_compiles
        compile_choice("e")                       # recent: reused
        assert manager.num_compiles == compiled
        compile_choice("a")                       # evicted: compiled again
        assert manager.num_compiles == compiled + 1
    finally:
        manager.shutdown()


def test_the_backend_load_is_not_the_grammars_compile_time(tmp_path):
    """The first compile also loads xgrammar's view of the tokenizer (once per process): a short
    --structured-outputs-compile-timeout must not fail the first requests of a slow machine for it."""
    import time

    import pagedserve.core.structured_output as so
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_serving_model
    folder = make_tiny_serving_model(str(tmp_path))

    def slow_tokenizer_dir() -> str:
        time.sleep(1.5)                                # a loaded machine: longer than the timeout below
        return folder
    manager = so.StructuredOutputManager(slow_tokenizer_dir, vocab_size=49152, stop_token_ids=[2],
                                         config=StructuredOutputsConfig(reasoning_parser=None, compile_timeout_s=1.0))
    try:
        state = manager.submit(StructuredOutputsParams(choice=["yes", "no"]))
        deadline = time.monotonic() + 60
        while True:
            ready, error = manager.poll(state, [1, 2, 3])
            assert error is None, error
            if ready:
                break
            assert time.monotonic() < deadline
            manager.wait_any([state], 0.05)
    finally:
        manager.shutdown()
