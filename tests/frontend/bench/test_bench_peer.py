"""`pagedserve bench peer` (frontend/bench/peer/): engine specs are typed and checked like engine-serve's flags,
the peer's peak-RSS watcher sees a real process's peak, a child process runs an engine on its threads and hands
back its result, and the subcommand's --help and usage errors come through the real CLI."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from pagedserve.frontend import pagedserve_cli
from pagedserve.frontend.bench.peer import child, cpu_peer, engines, llama_server


def test_pagedserve_options_are_typed_as_engine_args():
    spec = engines.parse_engine("pagedserve-x:max_num_seqs=4,enable_prefix_caching=false,dtype=float32,"
                              "max_model_len=none,kv_cache_memory=0.5")
    assert spec == {"name": "pagedserve-x", "kind": "pagedserve",
                    "options": {"max_num_seqs": 4, "enable_prefix_caching": False, "dtype": "float32",
                                "max_model_len": None, "kv_cache_memory": 0.5}}
    assert engines.parse_engine("pagedserve") == {"name": "pagedserve", "kind": "pagedserve", "options": {}}


def test_pagedserve_env_options_go_to_its_process():
    spec = engines.parse_engine("pagedserve-off:env.PAGEDSERVE_CPU_DECODE_STEP=0,max_num_seqs=4")
    assert spec == {"name": "pagedserve-off", "kind": "pagedserve", "options": {"max_num_seqs": 4},
                    "env": {"PAGEDSERVE_CPU_DECODE_STEP": "0"}}
    with pytest.raises(ValueError, match="variable name"):
        engines.parse_engine("pagedserve:env.=1")


def test_engine_kinds():
    assert engines.parse_engine("llama.cpp")["kind"] == "llama"
    assert engines.parse_engine("hf:batch=8") == {"name": "hf", "kind": "hf", "options": {"batch": "8"}}


@pytest.mark.parametrize("text, field", [
    ("pagedserve:no_such_field=1", "no_such_field"),
    ("pagedserve:model=/x.gguf", "model"),
    ("pagedserve:dtype=int3", "dtype"),
    ("pagedserve:max_num_seqs=many", "max_num_seqs"),
    ("pagedserve:enforce_eager=maybe", "enforce_eager"),
    ("pagedserve:max_num_seqs", "max_num_seqs"),
    ("llama.cpp:threads=4", "takes no options"),
    ("hf:batch=0", "batch"),
    ("hf:beams=2", "beams"),
    ("vllm", "vllm"),
])
def test_bad_engine_specs_name_the_problem(text, field):
    with pytest.raises(ValueError, match=field):
        engines.parse_engine(text)


def test_w1_cap_keeps_prompts():
    cfg = {"num_requests": 5, "max_tokens": 8}
    full = engines.w1_requests({**cfg, "max_tokens": None})
    capped = engines.w1_requests(cfg)
    assert [p for p, _ in capped] == [p for p, _ in full]
    assert [m for _, m in capped] == [min(m, 8) for _, m in full]
    assert len(full) == 5 and any(m > 8 for _, m in full)


def test_rss_sampler_sees_the_peak_of_a_process_that_frees_it():
    # 200 MiB touched, freed, then the process idles: only the peak, not the current RSS, shows it.
    code = ("import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; "
            "print('freed', flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        sampler = llama_server.RssSampler(proc.pid, interval_s=1.0)
        assert proc.stdout.readline().strip() == "freed"
        time.sleep(0.1)
        peak = sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    assert peak >= 200


def cli(*args: str) -> subprocess.CompletedProcess:
    """`pagedserve ARGS` as a user runs it (the package's entry point, in a process of its own)."""
    return subprocess.run([sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_help_is_the_benchmarks_own():
    proc = cli("bench", "peer", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "side by side on CPU (issue 14)" in proc.stdout and "pagedserve bench peer --repeats 3" in proc.stdout
    for flag in ("--engine", "--gguf", "--llama-server", "--llama-parallel", "--result-file"):
        assert flag in proc.stdout
    assert "peer" in cli("bench", "--help").stdout


@pytest.mark.parametrize("argv, message", [
    (["--engine", "vllm"], "the name must be llama.cpp"),
    (["--engine", "hf", "--engine", "hf:batch=4"], "names must differ"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_bad_flags_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        pagedserve_cli.parse_args(["bench", "peer", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_engines_are_parsed_before_the_run():
    args = pagedserve_cli.parse_args(["bench", "peer", "--engine", "llama.cpp", "--engine", "pagedserve:max_num_seqs=4"])
    assert args.engine_specs == [{"name": "llama.cpp", "kind": "llama", "options": {}},
                                 {"name": "pagedserve", "kind": "pagedserve", "options": {"max_num_seqs": 4}}]
    assert args.run is cpu_peer.main


def test_a_child_runs_on_its_threads_and_reports(tmp_path, monkeypatch):
    # A module of the test's own, run the way the benchmarks run theirs: python -m ...peer.child MODULE PAYLOAD.
    (tmp_path / "echo_child.py").write_text(textwrap.dedent("""
        import json, os
        from pagedserve.frontend.bench.peer.child import report

        def child_main(payload):
            print("noise before the result")
            report({"payload": json.loads(payload), "omp": os.environ["OMP_NUM_THREADS"]})
        """))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    assert child.run_child("echo_child", '{"n": 3}', 3, "echo") == {"payload": {"n": 3}, "omp": "3"}
    with pytest.raises(RuntimeError, match=r"no_such_child failed \(exit 1\)"):
        child.run_child("no_such_child", "{}", 1, "no_such_child")
