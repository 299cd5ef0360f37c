"""Tensor parallelism from a plain user script: with or without a main guard, with or without shutdown().

Each script runs as its own `python` process (as a user would run it), with a unique marker in its
environment; the engine's processes inherit it, so after the script ends any process still carrying the
marker is one it left behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from pagedserve import LLM, SamplingParams

MARKER_ENV = "PAGEDSERVE_TEST_SCRIPT_MARKER"
PROMPT = [5, 6, 7, 8, 9, 10]
RUN_BOUND_S = 240          # a TP=3 start on a loaded 2-core machine
EXIT_BOUND_S = 30          # from the script's last line to its exit (before: never)

_HEADER = """
import json
from pagedserve import LLM, SamplingParams
MODEL = {model!r}
PROMPT = {prompt!r}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)
def show(llm, tag="TOKENS"):
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    print(tag, json.dumps(out[0].outputs[0].token_ids), flush=True)
"""


@pytest.fixture(scope="module")
def tp3_model(tmp_path_factory) -> str:
    """6 query / 3 KV heads and an intermediate size divisible by 3, so 3 ranks split it evenly."""
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_tp3")), arch="llama", hidden_size=48,
                           num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)


@pytest.fixture(scope="module")
def tp1_tokens(tp3_model) -> list[int]:
    with LLM(tp3_model, dtype="float32", max_model_len=128) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return out[0].outputs[0].token_ids


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_ENV) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _left_behind(marker: str, grace_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + grace_s
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [" ".join(p.cmdline()) for p in left]


class ScriptRun:
    """Runs `body` (after the common header) as a script; records when each output line arrived."""

    def __init__(self, tmp_path, model: str, body: str) -> None:
        self.marker = uuid.uuid4().hex
        path = tmp_path / f"script_{self.marker[:8]}.py"
        path.write_text(_HEADER.format(model=model, prompt=PROMPT) + textwrap.dedent(body))
        env = {**os.environ, MARKER_ENV: self.marker}
        self.stderr_path = tmp_path / f"stderr_{self.marker[:8]}.txt"
        with open(self.stderr_path, "w") as stderr:      # a file: an unread pipe could fill and stall the script
            self.proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=stderr,
                                         env=env, cwd=tmp_path, text=True)
        self.lines: list[tuple[float, str]] = []

    def read_until_exit(self) -> int:
        """Reads stdout to its end, then waits for the exit; the script is killed past RUN_BOUND_S."""
        try:
            for line in self.proc.stdout:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
            return self.proc.wait(timeout=RUN_BOUND_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def tagged(self, tag: str) -> list[tuple[float, list[int]]]:
        return [(t, json.loads(line.split(" ", 1)[1])) for t, line in self.lines if line.startswith(tag + " ")]

    def stderr_tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]


def _check_exits_promptly(run: ScriptRun, code: int, tag: str = "TOKENS") -> list[int]:
    exited_at = time.monotonic()
    assert code == 0, run.stderr_tail()
    outputs = run.tagged(tag)
    assert outputs, run.stderr_tail()
    tokens = outputs[-1][1]
    printed_at = run.lines[-1][0]     # the script's last line, whatever its tag: the exit is timed from there
    assert exited_at - printed_at < EXIT_BOUND_S, f"exit took {exited_at - printed_at:.1f} s after the last output"
    assert _left_behind(run.marker) == []
    return tokens


def test_tp3_without_main_guard_matches_tp1(tmp_path, tp3_model, tp1_tokens):
    """Module-level LLM(tensor_parallel_size=3), no guard, no shutdown(): the workers never re-import the
    script (with multiprocessing's spawn every worker died in bootstrapping), and the script exits."""
    run = ScriptRun(tmp_path, tp3_model, """
        llm = LLM(MODEL, dtype="float32", max_model_len=128, tensor_parallel_size=3)
        show(llm)
    """)
    assert _check_exits_promptly(run, run.read_until_exit()) == tp1_tokens


@pytest.mark.parametrize("core_process", [False, True], ids=["core-here", "core-process"])
def test_guarded_script_without_shutdown_exits(tmp_path, tp3_model, tp1_tokens, core_process):
    """A guarded script that never calls shutdown(), its engine core here (before: it printed, then hung
    at exit, multiprocessing joining workers nobody had stopped) or in its own process with the 3 workers
    under it: it exits at its end, and no core or worker is left behind."""
    run = ScriptRun(tmp_path, tp3_model, f"""
        def main():
            llm = LLM(MODEL, dtype="float32", max_model_len=128, tensor_parallel_size=3,
                      multiprocess_core={core_process})
            show(llm)

        if __name__ == "__main__":
            main()
    """)
    assert _check_exits_promptly(run, run.read_until_exit()) == tp1_tokens


def test_with_block_and_explicit_shutdown(tmp_path, tp3_model, tp1_tokens):
    """`with LLM(...) as llm:` stops the engine at the block's end (checked inside the script: no child
    left), shutdown() stops it too and may be called again."""
    run = ScriptRun(tmp_path, tp3_model, """
        import psutil, time

        def children():       # the engine's processes under this script
            return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
                    and any("pagedserve" in part for part in p.cmdline())]

        if __name__ == "__main__":
            with LLM(MODEL, dtype="float32", max_model_len=128, tensor_parallel_size=3) as llm:
                print("INSIDE", len(children()), flush=True)
                show(llm, "WITH")
            print("AFTER_WITH", len(children()), flush=True)
            llm = LLM(MODEL, dtype="float32", max_model_len=128, tensor_parallel_size=3, multiprocess_core=True)
            show(llm, "SHUTDOWN")
            llm.shutdown()
            llm.shutdown()
            print("AFTER_SHUTDOWN", len(children()), flush=True)
    """)
    code = run.read_until_exit()
    assert _check_exits_promptly(run, code, "WITH") == tp1_tokens
    assert run.tagged("SHUTDOWN")[-1][1] == tp1_tokens
    assert run.tagged("INSIDE")[0][1] == 3                 # the three ranks, under the script
    assert run.tagged("AFTER_WITH")[0][1] == 0
    assert run.tagged("AFTER_SHUTDOWN")[0][1] == 0


def test_killed_script_leaves_no_process(tmp_path, tp3_model):
    """SIGKILL of the script (no atexit runs): its engine core and workers still go, with their parent."""
    run = ScriptRun(tmp_path, tp3_model, """
        import time
        llm = LLM(MODEL, dtype="float32", max_model_len=128, tensor_parallel_size=3, multiprocess_core=True)
        show(llm)
        time.sleep(600)
    """)
    try:
        while (line := run.proc.stdout.readline()) and not line.startswith("TOKENS"):
            pass
        assert len(_marked(run.marker)) == 5, run.stderr_tail()     # script, core, three workers
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=10)
        assert _left_behind(run.marker, grace_s=15.0) == []
    finally:
        if run.proc.poll() is None:
            run.proc.kill()


def test_module_process_payload_sentinel_and_exit_code(tmp_path, monkeypatch):
    """ModuleProcess, as the executor's monitor uses it: the payload arrives on stdin, the sentinel fd
    becomes readable when the child exits, exitcode is its status (negative: the killing signal)."""
    import multiprocessing.connection

    from pagedserve.common.process_utils import ModuleProcess
    (tmp_path / "ps_probe_child.py").write_text(textwrap.dedent("""
        import sys, time
        from pagedserve.common.process_utils import read_launch_payload
        payload = read_launch_payload().decode()
        print("GOT", payload, flush=True)
        time.sleep(600 if payload == "wait" else 0)
        sys.exit(3)
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    quick = ModuleProcess("ps_probe_child", b"quick", name="probe")
    assert multiprocessing.connection.wait([quick.sentinel], timeout=60) == [quick.sentinel]
    quick.join(5)
    assert quick.exitcode == 3 and not quick.is_alive()
    slow = ModuleProcess("ps_probe_child", b"wait", name="probe")
    assert multiprocessing.connection.wait([slow.sentinel], timeout=1.0) == [] and slow.is_alive()
    slow.kill()
    assert multiprocessing.connection.wait([slow.sentinel], timeout=30) == [slow.sentinel]
    slow.join(5)
    assert slow.exitcode == -signal.SIGKILL
    for proc in (quick, slow):
        proc.close()
