"""OutputProcessor: engine-core token ids -> RequestOutputs (output kinds, n > 1, stop strings, logprobs,
errors, aborts), with real tokenizers.

Most cases use the synthetic word-level tokenizer (id i is the word "w<i>"; no model file needed), so the
expected text can be written down: after a prompt, the output ids 20, 21 read " w20 w21".
"""
from __future__ import annotations

import pytest

from pagedserve.common.errors import INVALID
from pagedserve.common.params.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.frontend.client.output_processor import OutputProcessor
from pagedserve.frontend.client.outputs import Logprob, RequestOutput
from pagedserve.ipc.messages import EngineCoreOutput, LogprobsEntry
from pagedserve.tests.helpers.models.tiny_models import embedded_tokenizer, synthetic_tokenizer

PROMPT = [10, 11]
DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def words():
    return synthetic_tokenizer(64)


def text_of(*ids: int) -> str:
    """What the synthetic tokenizer makes of output ids after a prompt: one " w<i>" per id."""
    return "".join(f" w{i}" for i in ids)


def start(tokenizer, kind: RequestOutputKind = CUMULATIVE, n: int = 1, **params) -> OutputProcessor:
    """An OutputProcessor with request "r" (children "r#0".. when n > 1) registered."""
    processor = OutputProcessor(tokenizer)
    p = SamplingParams(max_tokens=16, output_kind=kind, **params)
    child_ids = ["r"] if n == 1 else [f"r#{i}" for i in range(n)]
    processor.add_request("r", "w10 w11", PROMPT, child_ids, [p] * n)
    return processor


def step(processor: OutputProcessor, *outputs: EngineCoreOutput) -> list[RequestOutput]:
    return processor.process_outputs(list(outputs)).request_outputs


STEPS = [[20], [21, 22], [23]]          # one engine output per step for request "r"; the last one finishes


def run_steps(processor: OutputProcessor) -> list[RequestOutput]:
    results = []
    for i, ids in enumerate(STEPS):
        last = i == len(STEPS) - 1
        results += step(processor, EngineCoreOutput("r", ids, finish_reason="length" if last else None,
                                                    num_cached_tokens=2))
    return results


def test_delta_outputs_carry_only_what_is_new(words):
    results = run_steps(start(words, DELTA))
    assert [r.outputs[0].text for r in results] == [text_of(20), text_of(21, 22), text_of(23)]
    assert [r.outputs[0].token_ids for r in results] == STEPS
    assert [r.finished for r in results] == [False, False, True]
    assert results[-1].outputs[0].finish_reason == "length" and results[-1].num_cached_tokens == 2


def test_cumulative_outputs_carry_everything_so_far(words):
    results = run_steps(start(words, CUMULATIVE))
    assert [r.outputs[0].text for r in results] == [text_of(20), text_of(20, 21, 22), text_of(20, 21, 22, 23)]
    assert [r.outputs[0].token_ids for r in results] == [[20], [20, 21, 22], [20, 21, 22, 23]]
    assert [r.finished for r in results] == [False, False, True]


def test_final_only_gives_one_output_at_the_end(words):
    processor = start(words, FINAL_ONLY)
    results = run_steps(processor)
    assert len(results) == 1 and results[0].finished
    out = results[0]
    assert out.outputs[0].text == text_of(20, 21, 22, 23) and out.outputs[0].token_ids == [20, 21, 22, 23]
    assert (out.request_id, out.prompt, out.prompt_token_ids) == ("r", "w10 w11", PROMPT)
    assert out.metrics["num_generation_tokens"] == 4 and "first_token_time" in out.metrics
    assert processor.num_unfinished() == 0


def test_n2_children_finish_separately(words):
    processor = start(words, CUMULATIVE, n=2)
    first = step(processor, EngineCoreOutput("r#0", [20]), EngineCoreOutput("r#1", [30]))
    assert len(first) == 1, "one RequestOutput per parent request, however many children moved"
    assert [c.text for c in first[0].outputs] == [text_of(20), text_of(30)]
    second = step(processor, EngineCoreOutput("r#0", [21], finish_reason="length"), EngineCoreOutput("r#1", [31]))
    assert not second[0].finished
    assert [c.finish_reason for c in second[0].outputs] == ["length", None]
    assert processor.unfinished_ids() == ["r#1"]
    third = step(processor, EngineCoreOutput("r#1", [32], finish_reason="length"))
    assert third[0].finished and [c.finish_reason for c in third[0].outputs] == ["length", "length"]
    assert [c.text for c in third[0].outputs] == [text_of(20, 21), text_of(30, 31, 32)]
    assert [c.index for c in third[0].outputs] == [0, 1] and processor.num_unfinished() == 0


def test_n2_final_only_waits_for_the_last_child(words):
    processor = start(words, FINAL_ONLY, n=2)
    assert step(processor, EngineCoreOutput("r#0", [20], finish_reason="length"),
                EngineCoreOutput("r#1", [30])) == []
    (out,) = step(processor, EngineCoreOutput("r#1", [31], finish_reason="length"))
    assert out.finished and [c.token_ids for c in out.outputs] == [[20], [30, 31]]


def test_n2_delta_reports_a_finished_child_once(words):
    processor = start(words, DELTA, n=2)
    step(processor, EngineCoreOutput("r#0", [20], finish_reason="length"), EngineCoreOutput("r#1", [30]))
    (later,) = step(processor, EngineCoreOutput("r#1", [31]))
    assert [(c.index, c.text) for c in later.outputs] == [(1, text_of(31))]


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_ends_the_sequence_and_asks_the_core_to_abort_it(words, include_stop):
    processor = start(words, CUMULATIVE, stop=[" w22"], include_stop_str_in_output=include_stop)
    step(processor, EngineCoreOutput("r", [20]))
    result = processor.process_outputs([EngineCoreOutput("r", [21, 22, 23])])
    assert result.reqs_to_abort == ["r"]
    (out,) = result.request_outputs
    completion = out.outputs[0]
    assert out.finished and completion.finish_reason == "stop" and completion.stop_reason == " w22"
    assert completion.text == (text_of(20, 21, 22) if include_stop else text_of(20, 21))
    # The core has not seen the abort yet and sends one more step: it is dropped.
    assert step(processor, EngineCoreOutput("r", [24])) == [] and "r" not in processor.unfinished_ids()


def test_delta_stream_never_leaks_a_stop_string(words):
    """A tail that may still become the stop string is held back, then dropped when it does."""
    processor = start(words, DELTA, stop=[" w22"])
    deltas = []
    for token in (20, 21, 22, 23):
        for out in step(processor, EngineCoreOutput("r", [token])):
            deltas.append(out.outputs[0].text)
    assert "".join(deltas) == text_of(20, 21)
    assert not any("w22" in d for d in deltas)


def test_stop_string_in_one_child_aborts_only_that_child(words):
    processor = start(words, CUMULATIVE, n=2, stop=[" w21"])
    result = processor.process_outputs([EngineCoreOutput("r#0", [20, 21]), EngineCoreOutput("r#1", [30, 31])])
    assert result.reqs_to_abort == ["r#0"]
    assert [c.finish_reason for c in result.request_outputs[0].outputs] == ["stop", None]
    assert processor.unfinished_ids() == ["r#1"]


def test_logprobs_become_dicts_with_ranks_and_decoded_tokens(words):
    processor = start(words, DELTA, logprobs=2)
    # Sampled 20 (3rd most likely), then the top-2 (40, 41); then sampled 21, which is also the top-1.
    first = LogprobsEntry(token_ids=[20, 40, 41], logprobs=[-2.0, -0.5, -1.0], sampled_rank=3)
    second = LogprobsEntry(token_ids=[21, 21, 42], logprobs=[-0.25, -0.25, -3.0], sampled_rank=1)
    (out1,) = step(processor, EngineCoreOutput("r", [20], new_logprobs=[first]))
    (out2,) = step(processor, EngineCoreOutput("r", [21], new_logprobs=[second], finish_reason="length"))
    assert out1.outputs[0].logprobs == [{20: Logprob(-2.0, 3, "w20"), 40: Logprob(-0.5, 1, "w40"),
                                         41: Logprob(-1.0, 2, "w41")}]
    # The sampled token is its own top-1: one entry, with the sampled rank (the first wins).
    assert out2.outputs[0].logprobs == [{21: Logprob(-0.25, 1, "w21"), 42: Logprob(-3.0, 2, "w42")}]
    assert out2.outputs[0].cumulative_logprob == pytest.approx(-2.25)


def test_cumulative_logprobs_keep_every_position(words):
    processor = start(words, CUMULATIVE, logprobs=0)
    step(processor, EngineCoreOutput("r", [20], new_logprobs=[LogprobsEntry([20], [-1.5], 1)]))
    (out,) = step(processor, EngineCoreOutput("r", [21], new_logprobs=[LogprobsEntry([21], [-0.5], 4)]))
    assert out.outputs[0].logprobs == [{20: Logprob(-1.5, 1, "w20")}, {21: Logprob(-0.5, 4, "w21")}]
    assert out.outputs[0].cumulative_logprob == pytest.approx(-2.0)


def test_without_logprobs_requested_there_are_none(words):
    (out,) = step(start(words, CUMULATIVE), EngineCoreOutput("r", [20], finish_reason="length"))
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_error_output_carries_its_kind_at_once_even_before_siblings_finish(words):
    processor = start(words, FINAL_ONLY, n=2)
    (out,) = step(processor, EngineCoreOutput("r#0", [], finish_reason="error", error="prompt too long",
                                              error_kind=INVALID))
    assert (out.error, out.error_kind) == ("prompt too long", INVALID)
    assert out.outputs[0].finish_reason == "error" and not out.finished
    assert processor.unfinished_ids() == ["r#1"]


def test_abort_request_forgets_the_children(words):
    processor = start(words, DELTA, n=2)
    step(processor, EngineCoreOutput("r#0", [20]), EngineCoreOutput("r#1", [30]))
    processor.abort_request(["r#0", "r#1", "never-added"])
    assert processor.num_unfinished() == 0 and "r#0" not in processor.unfinished_ids()
    assert step(processor, EngineCoreOutput("r#0", [21]), EngineCoreOutput("r#1", [31])) == []


def test_smollm2_tokenizer_text_and_stop_string():
    """The embedded SmolLM2 byte-level BPE: streamed text adds up to the decode, cut at the stop string."""
    tokenizer = embedded_tokenizer()
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    ids = tokenizer.encode(" there was a cat. It sat on the mat.", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=len(ids), output_kind=DELTA, stop=[" sat"])
    processor.add_request("r", None, prompt, ["r"], [params])
    deltas, aborted = [], []
    for token in ids:
        result = processor.process_outputs([EngineCoreOutput("r", [token])])
        deltas += [out.outputs[0].text for out in result.request_outputs]
        aborted += result.reqs_to_abort
    assert "".join(deltas) == " there was a cat. It"
    assert aborted == ["r"] and "r" not in processor.unfinished_ids()
