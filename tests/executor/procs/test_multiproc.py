"""The process split: engine core process, worker processes, tensor parallelism, faults."""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.frontend.client.core_client import EngineDeadError, SyncMPClient
from pagedserve.frontend.client.core_process import CoreProcess
from pagedserve.ipc.messages import EngineCoreRequest
from pagedserve.tests.helpers.models.tiny_models import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LENGTHS = [5, 40, 17, 90, 1, 63]


# Processes this test process had before the test (another module's server of the pool, in the same xdist
# worker): not the test's to stop, so not counted as left behind.
_BEFORE: set[tuple[int, float]] = set()


@pytest.fixture(autouse=True)
def _earlier_children():
    _BEFORE.clear()
    _BEFORE.update((p.pid, p.create_time()) for p in psutil.Process().children(recursive=True))
    yield


def children() -> list[psutil.Process]:
    """The live processes under this one that the running test started."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (p.pid, p.create_time()) not in _BEFORE and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_no_children(timeout=10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in children() if "resource_tracker" not in " ".join(p.cmdline())]
        if not left:
            return []
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def tp1_tokens(tiny_llama_dir):
    prompts = random_prompts(3, LENGTHS, 512)
    with LLM(tiny_llama_dir, dtype="float32") as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def test_tp2_matches_tp1(tiny_llama_dir, tp1_tokens):
    prompts, expected = tp1_tokens
    with LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert wait_no_children() == []


def test_core_process_matches_inprocess(tiny_llama_dir, tp1_tokens):
    prompts, expected = tp1_tokens
    with LLM(tiny_llama_dir, dtype="float32", multiprocess_core=True) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert wait_no_children() == []


def test_worker_calls_only_its_remote_methods(tiny_llama_dir):
    """One allowlist, Worker.REMOTE_METHODS, for every executor (test_frames covers worker processes)."""
    from pagedserve.executor.worker.worker import Worker
    worker = Worker(EngineArgs(model=tiny_llama_dir, dtype="float32").create_engine_config())
    assert worker.call_remote("ping", []) == "pong"
    for method in ("load_model", "execute_model", "call_remote", "__init__", "config", "nope"):
        with pytest.raises(ValueError, match=f"{method!r} is not callable remotely"):
            worker.call_remote(method, [])
    with LLM(tiny_llama_dir, dtype="float32") as llm:      # the in-process executor
        with pytest.raises(ValueError, match="'load_model' is not callable remotely"):
            llm.engine.executor.collective_rpc("load_model")


def test_tp_divisibility_refused_with_message(smollm2_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's 9 attention heads"):
        EngineArgs(model=smollm2_path, tensor_parallel_size=2).create_engine_config()


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(smollm2_path):
    prompts = random_prompts(4, [12, 70, 33], 49152)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(smollm2_path, dtype="float32", max_model_len=256, quantization="none") as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(smollm2_path, dtype="float32", max_model_len=256, quantization="none", tensor_parallel_size=3) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_worker_startup_failure_reaches_caller(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank [01] failed to start: .*safetensors|worker rank [01] failed to start: "):
        LLM(str(broken), dtype="float32", tensor_parallel_size=2)
    assert time.monotonic() - start < 60
    assert wait_no_children() == []


def test_core_startup_failure_reaches_caller(tiny_llama_dir):
    # Only the engine core can find this out: its KV cache cannot hold one max-length request.
    with pytest.raises(RuntimeError, match="engine core failed to start: ValueError: the KV cache holds 2 blocks"):
        LLM(tiny_llama_dir, multiprocess_core=True, num_gpu_blocks_override=2)
    assert wait_no_children() == []


def _worker_pids() -> list[int]:
    return [p.pid for p in children() if "pagedserve-worker" in p.name() or
            any("worker_proc" in c or "run_worker" in c for c in p.cmdline())]


def test_sigkill_worker_fails_requests_fast(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2, multiprocess_core=True)
    prompts = random_prompts(5, [30] * 4, 512)
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    core_pid = llm.client.proc.proc.pid
    workers = [p for p in psutil.Process(core_pid).children() if p.name().startswith("ps-worker")]
    assert len(workers) == 2
    timer = threading.Timer(2.0, lambda: os.kill(workers[1].pid, signal.SIGKILL))
    timer.start()
    start = time.monotonic()
    with pytest.raises((EngineDeadError, ValueError), match="worker rank 1 died"):
        llm.generate(prompts, params, use_tqdm=False)
    assert time.monotonic() - start < 2.0 + 5.0
    llm.shutdown()
    assert wait_no_children() == []


def test_sigkill_core_raises_engine_dead(tiny_llama_dir):
    proc = CoreProcess(EngineArgs(model=tiny_llama_dir, dtype="float32"))
    client = SyncMPClient(proc.addresses, proc.token, proc)
    client.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), 0.0))
    assert client.get_output(timeout_s=30) is not None
    os.kill(proc.proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        for _ in range(100):
            client.get_output(timeout_s=0.2)
    client.close()
    assert wait_no_children() == []


def test_two_engines_side_by_side(tiny_llama_dir, tp1_tokens):
    prompts, expected = tp1_tokens
    a = LLM(tiny_llama_dir, dtype="float32", multiprocess_core=True)
    b = LLM(tiny_llama_dir, dtype="float32", multiprocess_core=True)
    try:
        assert a.client.addresses.input != b.client.addresses.input
        results = {}
        threads = [threading.Thread(target=lambda n, e: results.__setitem__(n, e.generate(prompts, GREEDY,
                                                                                          use_tqdm=False)),
                                    args=(name, eng)) for name, eng in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for name in "ab":
            assert [o.outputs[0].token_ids for o in results[name]] == expected
    finally:
        a.shutdown()
        b.shutdown()
    assert wait_no_children() == []


def test_torchrun_launcher_two_cpu_ranks(tiny_llama_dir, tp1_tokens):
    import json
    import pathlib
    import subprocess
    import sys

    from pagedserve.tests.helpers.processes.server import free_port as free_tcp_port
    prompts, expected = tp1_tokens
    root = pathlib.Path(__file__).resolve().parents[3]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_tcp_port()), str(root / "scripts" / "torchrun_launch.py"),
           "--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", str(GREEDY.max_tokens)]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["token_ids"] for r in rows] == expected


_TORCHRUN_RPC = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
if dist.get_rank() == 0:
    from pagedserve import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2, distributed_executor_backend="torchrun",
              worker_extension_cls="pagedserve.tests.helpers.rl.rl_extension.Probe")
    print("RPC " + json.dumps(llm.collective_rpc("describe_rank", kwargs={"tag": "torchrun"})), flush=True)
    for method in ("no_such_method", "weight_tensor"):
        try:
            llm.collective_rpc(method)
        except ValueError as exc:
            print("REFUSED " + json.dumps(str(exc)), flush=True)
    llm.reload_weights()
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    print("TOKENS " + json.dumps(out[0].outputs[0].token_ids), flush=True)
    llm.shutdown()
else:
    from pagedserve.executor.procs.torchrun_executor import serve_torchrun_worker
    serve_torchrun_worker(120.0)
dist.barrier()
dist.destroy_process_group()
"""


def test_torchrun_collective_rpc_takes_kwargs_and_survives_refusals(tiny_llama_dir, tmp_path):
    """collective_rpc under a torchrun launch: kwargs reach every rank, and a refused call (an unknown
    method, a result that is not data) is an error for the caller while every rank keeps serving."""
    import json
    import subprocess
    import sys

    from pagedserve.tests.helpers.processes.server import free_port as free_tcp_port
    script = tmp_path / "rpc.py"
    script.write_text(_TORCHRUN_RPC)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_tcp_port()), str(script), tiny_llama_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line]
    tagged = {tag: [json.loads(rest) for t, rest in lines if t == tag] for tag in ("RPC", "REFUSED", "TOKENS")}
    assert tagged["RPC"] == [[{"rank": r, "tp_rank": r, "rows": 64, "tag": "torchrun"} for r in (0, 1)]]
    assert [m in e for m, e in zip(("no_such_method", "weight_tensor"), tagged["REFUSED"])] == [True, True]
    assert len(tagged["TOKENS"][0]) == 4


def _torchrun_rank(launcher_pid: int, rank: str, wait_s: float = 30.0) -> psutil.Process:
    """The rank's own process: the highest one in the launcher's tree whose environment says RANK=rank
    (its own children inherit the variable; a process caught between fork and exec does not have it yet)."""
    deadline = time.monotonic() + wait_s
    while True:
        seen = []
        for p in psutil.Process(launcher_pid).children(recursive=True):
            try:
                env_rank = p.environ().get("RANK")
                seen.append((p.pid, env_rank, p.status()))
                alive = p.status() != psutil.STATUS_ZOMBIE
                if env_rank == rank and alive and p.parent().environ().get("RANK") != rank:
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if time.monotonic() > deadline:
            raise AssertionError(f"no live process with RANK={rank} under the launcher: {seen}")
        time.sleep(0.2)


def test_torchrun_stopped_rank_fails_the_launch(tiny_llama_dir):
    """A SIGSTOPped rank keeps the others waiting in a collective: bounded by --worker-heartbeat-timeout,
    the launch fails with an error instead of hanging. torchrun then ends the job with SIGTERM, which a
    stopped rank sees only once resumed: resumed then, it ends at once instead of at torchrun's SIGKILL 30 s
    later (a grace that torch 2.13's --shutdown-timeout does not shorten when a rank has failed)."""
    import pathlib
    import subprocess
    import sys

    from pagedserve.tests.helpers.processes.server import free_port as free_tcp_port
    timeout_s = 5.0
    root = pathlib.Path(__file__).resolve().parents[3]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_tcp_port()), str(root / "scripts" / "torchrun_launch.py"),
           "--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", "900", "--log-level", "info",
           "--worker-heartbeat-timeout", str(timeout_s)] + ["--prompt-ids", "5,6,7,8"] * 4
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    rank1 = None
    try:
        lines = []
        for line in proc.stdout:              # rank 0 logs this once the engine is ready to generate
            lines.append(line)
            if "engine core ready" in line:
                break
        else:
            raise AssertionError(f"the launch ended (rc {proc.wait()}) before its engine was ready: "
                                 + "".join(lines)[-3000:])
        rank1 = _torchrun_rank(proc.pid, "1")
        rank1.suspend()
        stopped_at = time.monotonic()
        hung = threading.Timer(timeout_s + 120, os.killpg, (proc.pid, signal.SIGKILL))   # fails the asserts
        hung.start()
        rest = ""
        for line in proc.stdout:
            rest += line
            if "closing signal SIGTERM" in line and rank1.is_running():    # rank 0 has failed the launch
                rank1.resume()
        proc.wait()
        hung.cancel()
        took = time.monotonic() - stopped_at
        assert proc.returncode != 0, "".join(lines) + rest
        assert not any(line.startswith("{") for line in rest.splitlines()), "rank 0 finished its prompts"
        assert took >= timeout_s - 1, took
        # Rank 0's collective gives up after the timeout; torchrun then ends the stopped rank.
        assert f"Timed out waiting {int(timeout_s * 1000)}ms" in rest, rest[-3000:]
    finally:
        if rank1 is not None and rank1.is_running():
            rank1.resume()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
