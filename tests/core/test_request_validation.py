"""Where a request is validated: once at each trust boundary (the frontend's input processor, the engine core's
socket), never when a message is decoded (every worker rank decodes each step's SchedulerOutput); and the
field at fault travels as data (RequestError.field) to the HTTP error's `param`, also across the core's socket."""
from __future__ import annotations

import json
import time

import pytest

from pagedserve import LLM
from pagedserve.common.errors import RequestError
from pagedserve.common.model.model_files import resolve_model, tokenizer_folder
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.common.params.structured_outputs import StructuredOutputsParams
from pagedserve.frontend.api_server import response_for
from pagedserve.frontend.client.input_processor import InputProcessor, ProcessedPrompt
from pagedserve.frontend.openai.protocol import ChatCompletionRequest
from pagedserve.frontend.openai.serving import error_body
from pagedserve.frontend.client.tokenizer import load_tokenizer
from pagedserve.ipc import messages as m
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder

TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees and sunny"},
]

# ------------------------------------------------------------------------------ decoding never validates


def _out_of_range() -> SamplingParams:
    """Values only the boundaries refuse (msgpack carries them: their types are right)."""
    return SamplingParams(temperature=-1.0, top_p=5.0, min_tokens=9, max_tokens=3,
                          structured_outputs=StructuredOutputsParams(choice=[]))


def test_a_worker_rank_decodes_a_step_without_validating():
    step = m.SchedulerOutput(
        scheduled_new_reqs=[m.NewRequestData("r", [1, 2, 3], [], _out_of_range(), [0], 0)],
        scheduled_cached_reqs=m.CachedRequestData(), num_scheduled_tokens={"r": 3}, total_num_scheduled_tokens=3,
        finished_req_ids=[])
    frames = MsgpackEncoder().encode(m.ExecuteModel(step))
    decoded = MsgpackDecoder(m.WorkerInput).decode(frames)           # what worker_proc does with each step
    params = decoded.scheduler_output.scheduled_new_reqs[0].sampling_params
    assert (params.temperature, params.top_p, params.structured_outputs.choice) == (-1.0, 5.0, [])
    with pytest.raises(RequestError) as err:                         # the boundaries do refuse it
        params.validate()
    assert err.value.field == "temperature" and str(err.value).startswith("temperature")


def test_normalization_survives_decoding_and_is_idempotent():
    params = SamplingParams(top_k=-1, stop="x", temperature=0.0, top_p=0.5)
    params.validate()
    again = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))
    assert again == params and (again.top_k, again.stop, again.top_p) == (0, ["x"], 1.0)
    again.validate()
    assert again == params


def test_construction_defers_the_rules_to_generate_time(tiny_llama_dir):
    params = SamplingParams(temperature=-1)            # no longer refused here: refused where it enters
    with LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02) as llm:
        with pytest.raises(ValueError, match="^temperature must be >= 0") as err:
            llm.generate("w1 w2", params, use_tqdm=False)
        assert err.value.field == "temperature"

# ------------------------------------------------------------------------------ the core's socket


@pytest.fixture(scope="module")
def mp_llm(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, multiprocess_core=True) as llm:
        yield llm


def _refusals(llm: LLM, requests: list[m.EngineCoreRequest]) -> dict[str, m.EngineCoreOutput]:
    for request in requests:
        llm.client.add_request(request)          # straight to the core's socket: no frontend checks
    ended: dict[str, m.EngineCoreOutput] = {}
    deadline = time.monotonic() + 60
    while len(ended) < len(requests) and time.monotonic() < deadline:
        step = llm.client.get_output(timeout_s=1.0)
        ended.update({o.request_id: o for o in (step.outputs if step else []) if o.finished})
    return ended


@pytest.mark.parametrize("rid, prompt, params, field", [
    ("temp", [5, 6], SamplingParams(temperature=-1), "temperature"),
    ("topp", [5, 6], SamplingParams(top_p=5.0), "top_p"),
    ("choice", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(choice=[])),
     "structured_outputs.choice"),
    ("vocab", [5, 10**9], SamplingParams(), "prompt_token_ids"),
    ("mintok", [5, 6], SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
])
def test_the_core_socket_refuses_naming_the_field(mp_llm, rid, prompt, params, field):
    [out] = _refusals(mp_llm, [m.EngineCoreRequest(rid, prompt, params, time.time())]).values()
    assert out.finish_reason == "error" and out.error_kind == "invalid"
    assert out.error_field == field and out.error.startswith(field), out


def test_a_used_id_is_refused_by_the_core(mp_llm):
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    mp_llm.client.add_request(m.EngineCoreRequest("dup", [5, 6], long, time.time()))
    [out] = _refusals(mp_llm, [m.EngineCoreRequest("dup", [7], SamplingParams(), time.time())]).values()
    mp_llm.client.abort_requests(["dup"])
    assert out.error_field == "request_id" and "already in use" in out.error
    # The core keeps serving, and the frontend's refusal of the same thing reads the same.
    assert mp_llm.generate("w1 w2", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids

# ------------------------------------------------------------------------------ param from the field


def _error(response) -> dict:
    return json.loads(response.body)["error"]


def test_http_param_is_the_field_not_the_first_word():
    # A message that does not start with its field: the param is still the field.
    err = _error(response_for(RequestError("temperature", "sampling temperature must be >= 0, got -1")))
    assert (err["code"], err["param"], err["message"]) == (400, "temperature",
                                                          "sampling temperature must be >= 0, got -1")
    # A plain ValueError names no field, whatever its first word looks like.
    assert _error(response_for(ValueError("top_p must be in (0, 1]")))["param"] is None
    # An error event of a stream that already answered 200 carries it too.
    event = error_body(RequestError.at("messages[1].tool_calls", "must be a list"))["error"]
    assert (event["code"], event["param"]) == (400, "messages[1].tool_calls")


def test_chat_max_tokens_unset_fills_what_the_truncated_prompt_leaves():
    """Truncation happens once, in the input processor; chat leaves max_tokens unset for it."""
    from pagedserve.tests.helpers.models.tiny_models import synthetic_tokenizer
    from pagedserve.ipc.messages import EngineInfo
    info = EngineInfo(served_model_name="m", model_path="/nowhere", tokenizer="/nowhere", max_model_len=16,
                      vocab_size=64, eos_token_ids=[2], max_waiting_requests=None, block_size=16, num_blocks=8)
    ip = InputProcessor(synthetic_tokenizer(64), info)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], truncate_prompt_tokens=4)
    params = body.to_sampling_params()
    assert params.max_tokens is None
    prepared = ip.make_requests("c", ProcessedPrompt(None, list(range(3, 23))), params)
    assert prepared.prompt.prompt_token_ids == [19, 20, 21, 22]
    with pytest.raises(RequestError) as err:      # min_tokens beyond what the prompt leaves
        ip.make_requests("c", ProcessedPrompt(None, [5] * 10), SamplingParams(max_tokens=None, min_tokens=7))
    assert err.value.field == "min_tokens"

# ------------------------------------------------------------------------------ the agent loop's second turn


@pytest.fixture(scope="module")
def smollm2_processor(smollm2_path):
    tokenizer = load_tokenizer(tokenizer_folder(resolve_model(smollm2_path)))
    info = m.EngineInfo(served_model_name="m", model_path=smollm2_path, tokenizer="", max_model_len=2048,
                        vocab_size=len(tokenizer), eos_token_ids=[2], max_waiting_requests=None, block_size=16,
                        num_blocks=8)
    return InputProcessor(tokenizer, info)


def test_tool_turns_render_with_smollm2s_own_template(smollm2_processor):
    """SmolLM2's template knows no tools and concatenates message['content']: a tool-calling assistant turn
    (content null) renders as an empty turn, as vLLM renders it."""
    assert "tool" not in smollm2_processor.tokenizer.chat_template    # the template really knows no tools
    # As the HTTP layer hands them over (pydantic drops the null) and as LLM.chat takes them (null kept).
    for messages in (ChatCompletionRequest(messages=TOOL_TURNS).text_messages(), TOOL_TURNS):
        text = smollm2_processor.apply_chat_template(messages).prompt
        assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n18 degrees and sunny<|im_end|>\n" \
               "<|im_start|>assistant\n" in text, text
