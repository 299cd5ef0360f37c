"""The one-call C decode step with LoRA rows (kernels/cpu/csrc/lora.c called from kernels/cpu/csrc/decode_step.c)
against the PyTorch layers with the same adapters on the same int8 base (PAGEDSERVE_CPU_DECODE_STEP=0): the same
greedy tokens and logprobs up to float32 summation order, for rows of the base, of an adapter of rank 8 on some
pieces of the merged layers (q and v of qkv, gate of gate_up, no o) and of a rank-16 adapter on every linear,
1 to 8 rows a step, mixed; and a row's results are the same bits alone as beside other rows of other adapters.
HF + PEFT parity of the adapters themselves is tests/executor/worker/lora/test_lora.py."""
from __future__ import annotations

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.kernels.cpu import decode_step as cpu_decode_step
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.tests.helpers.models.lora_adapters import ALL_LINEAR, make_lora
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model, random_prompts

LIB = cpu_native.library()
pytestmark = pytest.mark.skipif(not cpu_decode_step.CpuDecodeStep.runs_here(),
                                reason="the C step needs the AVX-512 or AVX2 + FMA build of the CPU kernels")
PARTIAL = ("q_proj", "v_proj", "gate_proj", "down_proj")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, dict[str, LoRARequest]]:
    root = tmp_path_factory.mktemp("step_lora")
    base = make_tiny_model(str(root / "base"), "llama", tie_word_embeddings=True)
    a = make_lora(str(root / "a"), base, r=8, alpha=16, targets=PARTIAL, seed=1)
    b = make_lora(str(root / "b"), base, r=16, alpha=8, targets=ALL_LINEAR, seed=2)
    return base, {"a": LoRARequest("a", 1, a), "b": LoRARequest("b", 2, b)}


def _spy(monkeypatch) -> list[tuple[int, list[int] | None]]:
    """The C step's calls: (rows, each row's adapter slot or None for a step without LoRA rows)."""
    calls = []
    real_call = cpu_decode_step.CpuDecodeStep.__call__

    def call(self, hidden, *args):
        lora = args[5] if len(args) > 5 else None
        calls.append((hidden.shape[0], None if lora is None else lora.tolist()))
        return real_call(self, hidden, *args)
    monkeypatch.setattr(cpu_decode_step.CpuDecodeStep, "__call__", call)
    return calls


Job = tuple[list[int], LoRARequest | None, int]        # prompt, adapter, max_tokens


def _run(base: str, batches: list[list[Job]], c_step: bool, monkeypatch, calls: list | None = None) -> list[list]:
    """Each batch through one engine, in turn; `calls` gets each batch's C step calls (see _spy)."""
    monkeypatch.setenv("PAGEDSERVE_CPU_DECODE_STEP", "1" if c_step else "0")
    outs, seen = [], []
    with LLM(base, dtype="float32", quantization="int8", max_model_len=256, enable_lora=True, max_loras=2,
             max_lora_rank=16) as llm:
        for jobs in batches:
            start = len(calls) if calls is not None else 0
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for _, _, n in jobs]
            got = llm.generate([{"prompt_token_ids": p} for p, _, _ in jobs], params, use_tqdm=False,
                               lora_request=[lora for _, lora, _ in jobs])
            outs.append([o.outputs[0] for o in got])
            seen.append(calls[start:] if calls is not None else [])
    if calls is not None:
        calls[:] = seen
    return outs


def _logprobs(out) -> list[float]:
    return [next(iter(step.values())).logprob for step in out.logprobs]


def test_c_step_with_adapters_matches_the_layers(model, monkeypatch):
    base, lora = model
    calls = _spy(monkeypatch)
    prompts = random_prompts(5, [6, 19, 33, 9, 14, 27, 4, 22, 11, 30, 16], vocab=512)
    mix = [lora["a"], None, lora["b"], lora["b"], lora["a"], None, lora["a"], lora["b"], None, lora["b"], lora["a"]]
    cases = [[(prompts[0], lora["a"], 20)],
             [(prompts[1], None, 16), (prompts[1], lora["a"], 16), (prompts[1], lora["b"], 16)],
             [(p, m, 6 + 2 * i) for i, (p, m) in enumerate(zip(prompts[:8], mix))],
             [(p, m, 4 + 2 * i) for i, (p, m) in enumerate(zip(prompts, mix))]]      # 11: past the GEMV's 8
    max_rows = cpu_native.library().ps_decode_step_max_rows()
    got = _run(base, cases, True, monkeypatch, calls)
    want = _run(base, cases, False, monkeypatch)
    for jobs, case_calls, got_outs, want_outs in zip(cases, calls, got, want):
        lora_calls = [(rows, slots) for rows, slots in case_calls if slots is not None and max(slots) >= 0]
        # The C step took steps with adapter rows, of up to max_rows rows, as many as the batch where it fits.
        assert lora_calls and max(rows for rows, _ in lora_calls) <= max_rows
        assert len(jobs) > max_rows or len(jobs) in [rows for rows, _ in lora_calls]
        if len(jobs) >= 3:      # base rows and two adapters' rows in one C step
            assert any(-1 in slots and len(set(slots) - {-1}) == 2 for _, slots in lora_calls)
        for g, w in zip(got_outs, want_outs):
            assert g.token_ids == w.token_ids
            diffs = [abs(x - y) for x, y in zip(_logprobs(g), _logprobs(w))]
            # As the base step's test (test_cpu_decode_step.py): the int8 GEMVs' int16 input steps; a delta
            # missed or applied to the wrong row or piece moves logprobs by 0.1 or more.
            assert max(diffs) < 5e-3, diffs
        if len(jobs) == 3:       # the same prompt under the base and each adapter: three answers
            assert len({tuple(o.token_ids) for o in got_outs}) == 3


def test_a_rows_results_do_not_depend_on_the_rows_beside_it(model, monkeypatch):
    """One-token prompts: every step of these requests is a C step, alone or eight rows of the base and two
    adapters; each request's tokens and logprobs are the same bits either way."""
    base, lora = model
    calls = _spy(monkeypatch)
    mix = [lora["a"], None, lora["b"], lora["a"], lora["b"], None, lora["b"], lora["a"]]
    jobs = [([100 + 37 * i], m, 12) for i, m in enumerate(mix)]
    together, *alone = _run(base, [jobs] + [[job] for job in jobs[:3]], True, monkeypatch, calls)
    assert all(rows <= 8 for rows, _ in calls[0]) and 8 in [rows for rows, _ in calls[0]]
    for out, (single,) in zip(together, alone):
        assert single.token_ids == out.token_ids and _logprobs(single) == _logprobs(out)
