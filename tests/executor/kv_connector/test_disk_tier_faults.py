"""The disk tier under faults (docs/kv_tiers.md, integrity): two writers on one folder, `kill -9` of a real
engine-serve mid-write and a restart on what it left, and a full disk (a real tmpfs) at start and mid-way."""
from __future__ import annotations

import errno
import glob
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.kv_transfer.layout import SUFFIX, TMP_SUFFIX
from pagedserve.tests.helpers.processes.server import SMALL_KV, Server
from pagedserve.tests.helpers.models.tiny_models import random_prompts

BS = 16
NAME = "tiny"
COMMON = (*SMALL_KV, "--block-size", str(BS), "--max-num-seqs", "8", "--served-model-name", NAME)


def _tier(path: str) -> tuple[str, ...]:
    return ("--kv-offloading-backend", "disk", "--kv-offloading-path", path, "--kv-offloading-size", "1")


def _blocks(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "*", "*", f"*{SUFFIX}")))


def _complete(server: Server, prompt: list[int]) -> str:
    choice = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True}).choices[0]
    assert choice.finish_reason == "length"
    return choice.text


# ---------------------------------------------------------------- two writers on one folder


def test_two_writers_on_one_folder_never_hand_a_reader_a_wrong_block(tmp_path):
    """Two processes, each a real BlockWriter (its own thread) writing the same keys with os.replace, reading
    every key back between batches and deleting some as the other's eviction: every read is whole and right
    or a miss, never damaged, and no temporary file is left."""
    cmd = [sys.executable, "-m", "pagedserve.tests.helpers.kv_hammer", str(tmp_path)]
    procs = [subprocess.Popen([*cmd, str(seed), "60"], stdout=subprocess.PIPE, text=True) for seed in (1, 2)]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for counts in results:
        assert counts["corrupt"] == counts["mismatch"] == 0
        assert counts["reads_ok"] > 100 and counts["saved"] == 60 * 8      # both wrote, both read hits
    assert glob.glob(os.path.join(str(tmp_path), "*", f"*{TMP_SUFFIX}")) == []


# ---------------------------------------------------------------- kill -9 mid-write, then a restart

PROMPTS = random_prompts(21, [64, 80, 96, 70, 50, 90, 100, 66], 2000)


@pytest.fixture(scope="module")
def reference(tiny_serving_model) -> list[str]:
    """Greedy outputs of a server without a tier (the disk tier's own tests check it against HF)."""
    plain = Server(*COMMON, model=tiny_serving_model, max_model_len=256)
    try:
        return [_complete(plain, p) for p in PROMPTS]
    finally:
        plain.stop()


def _kill_tree(server: Server) -> None:
    procs = [psutil.Process(server.proc.pid), *server.children()]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def test_kill_9_mid_write_leaves_nothing_a_restart_misreads(tiny_serving_model, reference, tmp_path):
    path = str(tmp_path)
    victim = Server(*COMMON, *_tier(path), model=tiny_serving_model, max_model_len=256)
    stop = threading.Event()

    def load() -> None:          # requests in flight, and blocks being written, until the kill
        while not stop.is_set():
            try:
                _complete(victim, PROMPTS[len(_blocks(path)) % len(PROMPTS)])
            except Exception:    # the server is gone: that is the point
                return
    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(load)
        deadline = time.monotonic() + 120
        while not _blocks(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        _kill_tree(victim)
        stop.set()
    files = _blocks(path)
    assert files, "no block was written before the kill"
    # What a kill mid-write leaves at worst, planted where the writer puts it: a temporary file cut short (a
    # young one, maybe another engine's write in progress; an old one, a dead writer's), and a block file cut
    # short (only a crash of the machine can leave one: there is no fsync).
    young = f"{files[0]}.999.1{TMP_SUFFIX}"
    stale = f"{files[-1]}.999.2{TMP_SUFFIX}"
    for tmp in (young, stale):
        with open(files[0], "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read()[:100])
    old = time.time() - 3600
    os.utime(stale, (old, old))
    with open(files[-1], "r+b") as f:
        f.truncate(os.path.getsize(files[-1]) // 2)

    restarted = Server(*COMMON, *_tier(path), model=tiny_serving_model, max_model_len=256)
    try:
        assert [_complete(restarted, p) for p in PROMPTS] == reference
        m = restarted.wait_idle()
    finally:
        restarted.stop()
    assert m["external_prefix_cache_hits_total"] > 0                  # what the victim stored came back
    assert m["kv_offload_disk_block_invalid_total"] >= 1             # the cut block: deleted, computed
    assert not os.path.exists(stale) and os.path.exists(young)       # a young one may be a live write


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB filesystem: room for a few of the tiny model's 8.5 KiB block files, then ENOSPC."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if run.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root with CAP_SYS_ADMIN: {run.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_is_refused_at_start_naming_the_flag(tiny_serving_model, small_tmpfs):
    fd = os.open(os.path.join(small_tmpfs, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    args = dict(kv_offloading_backend="disk", kv_offloading_path=small_tmpfs, kv_offloading_size=1)
    with pytest.raises(ValueError, match=r"--kv-offloading-path: .* not writable \(or full\): No space left"):
        EngineArgs(tiny_serving_model, **args).create_engine_config()


def test_a_disk_that_fills_degrades_to_recompute_with_one_warning(tiny_serving_model, small_tmpfs):
    server = Server(*COMMON, *_tier(small_tmpfs), model=tiny_serving_model, max_model_len=256)
    try:
        prompts = random_prompts(22, [64] * 8, 2000)          # 4 blocks each: 32 blocks, room for ~5
        texts = [_complete(server, p) for p in prompts]
        again = [_complete(server, p) for p in prompts]       # requests keep flowing after saving stopped
        m = server.wait_idle()
        log = server.output()
    finally:
        server.stop()
    assert len(texts) == len(again) == 8 and server.proc.returncode is not None
    warnings = [line for line in log.splitlines() if "KV disk tier: cannot write" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "saving stops" in warnings[0]
    assert m["kv_offload_stores_skipped_total"] > 0
    assert 0 < len(_blocks(small_tmpfs)) < 32
    assert glob.glob(os.path.join(small_tmpfs, "*", "*", f"*{TMP_SUFFIX}")) == []    # a failed write cleans up
