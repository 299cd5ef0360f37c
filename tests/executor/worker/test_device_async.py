"""Async scheduling on the device: a step is launched before the previous step's sampled ids reach the host.

The worker's next step then reads those ids from the device (step_buffers.apply_pending) and the host value
is filled when the output is taken. Here the real worker launches each step on the core's own thread, so
step N+1 is always launched before step N's output is taken, and every decode reads a pending id: the
tokens must equal synchronous scheduling's, for greedy, seeded, penalised (which waits for its ids) and
logprob rows, across preemption. On a GPU (CUDA graphs on) the ids really are still on the device."""
from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.common.config.engine_args import EngineArgs, EngineConfig
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.uniproc_executor import UniProcExecutor
from pagedserve.executor.worker.step_buffers import StepBuffers
from pagedserve.executor.worker.step_output import PendingStep
from pagedserve.ipc.messages import EngineCoreRequest, SchedulerOutput
from pagedserve.tests.helpers.models.tiny_models import random_prompts


class LaunchInLine(UniProcExecutor):
    """The uni executor with the step launched on the caller's thread: deterministic overlap, the core
    takes step N's output only after launching step N+1."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.pending_reads = 0
        buffers = self.worker.runner.buffers
        apply = buffers.apply_pending

        def counted(input_ids, pending):
            self.pending_reads += len(pending)
            apply(input_ids, pending)
        buffers.apply_pending = counted

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingStep:
        return self.worker.execute_model_async(scheduler_output)


def params() -> list[SamplingParams]:
    rows = [SamplingParams(temperature=0.0, max_tokens=20),
            SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=17),
            SamplingParams(temperature=0.0, max_tokens=15, repetition_penalty=1.3, frequency_penalty=0.5),
            SamplingParams(temperature=0.8, seed=9, max_tokens=22, logprobs=3),
            SamplingParams(temperature=0.0, max_tokens=11, min_tokens=6),
            SamplingParams(temperature=0.7, max_tokens=13, presence_penalty=0.8, seed=3)]
    return rows


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """The tiny Llama with a synthetic tokenizer: these tests read token ids only, and a GPU machine may not
    have the embedded model whose tokenizer the shared fixture uses."""
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("llama_async")), arch="llama", tokenizer="synthetic")


def run(path: str, executor, async_on: bool, **kw) -> tuple[dict, EngineCore]:
    args = EngineArgs(model=path, dtype="float32", generation_config="vllm", block_size=4,
                      max_model_len=256, max_num_batched_tokens=64, async_scheduling=async_on, **kw)
    core = EngineCore.from_engine_args(args, executor)
    prompts = random_prompts(21, [9, 70, 33, 5, 120, 18], 500)
    for i, (prompt, p) in enumerate(zip(prompts, params())):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, p, arrival_time=float(i)))
    done: dict[str, tuple[list[int], list, str | None]] = {}
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            tokens, lps, _ = done.get(out.request_id, ([], [], None))
            lps = lps + [(e.token_ids, e.logprobs) for e in out.new_logprobs or []]
            done[out.request_id] = (tokens + list(out.new_token_ids), lps, out.finish_reason)
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    return done, core


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks", [None, 64], ids=["roomy", "preempting"])
def test_pending_ids_read_on_the_device_equal_sync(llama_dir, blocks, device):
    # A fixed block count: the two engines live in one process, and a GPU one would size its cache by the
    # memory the other left.
    kw = dict(device=device, num_gpu_blocks_override=blocks or 512)
    want, _ = run(llama_dir, UniProcExecutor, False, **kw)
    got, core = run(llama_dir, LaunchInLine, True, **kw)
    assert core.executor.pending_reads > 20          # the decodes really read ids the host did not have
    assert set(got) == set(want)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        assert got[rid][2] == want[rid][2], rid
        for (gi, gl), (wi, wl) in zip(got[rid][1], want[rid][1]):
            assert gi == wi and gl == pytest.approx(wl, rel=1e-4, abs=1e-5), rid
    assert (core.scheduler.num_preemptions > 0) == (blocks is not None)


def test_apply_pending_writes_device_ids_into_the_inputs():
    class Sampled:
        def __init__(self, ids):
            self.ids = torch.tensor(ids)

        def device_ids(self):
            return self.ids
    a, b = Sampled([11, 12, 13]), Sampled([21, 22])
    inputs = torch.full((6,), -1, dtype=torch.int64)
    StepBuffers.apply_pending(inputs, [(0, a, 2), (3, b, 1), (5, a, 0)])
    assert inputs.tolist() == [13, -1, -1, 22, -1, 11]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_memory_growth_over_1000_async_steps(llama_dir):
    """Each launched step holds its sampled ids on the device until the next step has read them: none may
    be kept past that (1,000 decode steps of 4 rows, CUDA graphs on)."""
    from pagedserve import LLM
    prompts = random_prompts(5, [9, 12, 7, 10], 500)
    with LLM(llama_dir, dtype="float32", device="cuda", async_scheduling=True, max_model_len=1024) as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        outs = llm.generate(prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=1000, ignore_eos=True),
                            use_tqdm=False)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1000] * 4
    assert after - before < (1 << 20), f"device memory grew by {after - before} bytes over 1,000 steps"
