"""`pagedserve bench peer` (frontend/bench/peer/): engine specs are typed and checked like engine-serve's flags,
and the peer's peak-RSS watcher sees a real process's peak."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pagedserve.frontend.bench.peer import engines, llama_server


def test_pagedserve_options_are_typed_as_engine_args():
    spec = engines.parse_engine("pagedserve-x:max_num_seqs=4,enable_prefix_caching=false,dtype=float32,"
                              "max_model_len=none,kv_cache_memory=0.5")
    assert spec == {"name": "pagedserve-x", "kind": "pagedserve",
                    "options": {"max_num_seqs": 4, "enable_prefix_caching": False, "dtype": "float32",
                                "max_model_len": None, "kv_cache_memory": 0.5}}
    assert engines.parse_engine("pagedserve") == {"name": "pagedserve", "kind": "pagedserve", "options": {}}


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

