"""The disk tier through the KV connector seam (docs/kv_tiers.md), on real engines: the engine without the tier
(itself checked against HF transformers) is the oracle; a restarted engine, in a process of its own, hits."""
from __future__ import annotations

import glob
import logging
import os
import shutil

import msgspec
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.ipc.messages import SchedulerStats
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, make_tiny_model, random_prompts

# 2, 2 and 4 full blocks of 16; with 6 tokens out, no block past the prompt's fills.
PROMPTS = random_prompts(48, [40, 37, 70], 512)
FULL_BLOCKS = [2, 2, 4]
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 16


def _tier(path: str, size_gib: float = 0.1) -> dict:
    return {"kv_offloading_backend": "disk", "kv_offloading_size": size_gib, "kv_offloading_path": path}


def _run(model: str, multiprocess_core: bool = False, **kwargs) -> tuple[list[list[int]], list[int], SchedulerStats]:
    """Token ids, cached tokens per prompt, and the engine's stats after the run."""
    with LLM(model, dtype="float32", max_model_len=128, block_size=BS, multiprocess_core=multiprocess_core,
             **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
        stats = msgspec.convert(llm.client.call_utility("get_stats"), SchedulerStats)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs], stats


def _files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "*", "*", "*.kvb")))


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, hf_tiny_llama) -> list[list[int]]:
    ids, _, _ = _run(tiny_llama_dir)
    assert ids == hf_greedy(hf_tiny_llama, PROMPTS, SP.max_tokens)
    return ids


@pytest.fixture(scope="module")
def warm_tier(tiny_llama_dir, tmp_path_factory, oracle) -> str:
    """A tier one engine filled (and shut down), read-only for the tests: copy it to change it. The engine's
    core and its worker run in processes of their own: the worker's writes in progress are flushed at exit."""
    path = str(tmp_path_factory.mktemp("warm_tier"))
    ids, cached, stats = _run(tiny_llama_dir, multiprocess_core=True, distributed_executor_backend="mp",
                              **_tier(path))
    assert ids == oracle and cached == [0, 0, 0]
    assert stats.external_prefix_cache_hits == 0 and stats.external_prefix_cache_queries == 147
    assert len(_files(path)) == sum(FULL_BLOCKS)            # every full prompt block, once
    return path


def _copy(tier: str, tmp_path) -> str:
    dest = str(tmp_path / "tier")
    shutil.copytree(tier, dest)
    return dest


def test_restarted_engine_hits_the_tier_with_identical_output(tiny_llama_dir, warm_tier, oracle, tmp_path):
    path = _copy(warm_tier, tmp_path)
    ids, cached, stats = _run(tiny_llama_dir, multiprocess_core=True, **_tier(path))
    assert ids == oracle
    assert cached == [n * BS for n in FULL_BLOCKS]           # every full block but the last token's came back
    assert stats.external_prefix_cache_hits == sum(FULL_BLOCKS) * BS
    assert len(_files(path)) == sum(FULL_BLOCKS)            # nothing stored twice


def test_async_scheduling_and_chunked_prefill_hit_alike(tiny_llama_dir, warm_tier, oracle, tmp_path):
    path = _copy(warm_tier, tmp_path)
    ids, cached, _ = _run(tiny_llama_dir, async_scheduling=True, max_num_batched_tokens=24, max_num_seqs=2,
                          **_tier(path))
    assert ids == oracle and cached == [n * BS for n in FULL_BLOCKS]


def test_another_model_or_kv_dtype_never_hits(tiny_llama_dir, warm_tier, tmp_path):
    path = _copy(warm_tier, tmp_path)
    other = make_tiny_model(str(tmp_path / "other"), arch="llama", seed=1)     # same shapes, other weights
    _, cached, stats = _run(other, **_tier(path))
    assert cached == [0, 0, 0] and stats.external_prefix_cache_hits == 0
    _, cached, stats = _run(tiny_llama_dir, kv_cache_dtype="bfloat16", **_tier(path))
    assert cached == [0, 0, 0] and stats.external_prefix_cache_hits == 0
    assert len(os.listdir(path)) == 3                      # one namespace folder each


def test_bad_files_are_misses_and_deleted(tiny_llama_dir, warm_tier, oracle, tmp_path):
    """A truncated, a corrupted and a foreign file (another block's under this one's name): each is a miss
    from there on, its tokens computed, and it is deleted. kv_consumer: the engine saves nothing back."""
    path = _copy(warm_tier, tmp_path)
    engine = EngineArgs(tiny_llama_dir, dtype="float32", max_model_len=128, block_size=BS, **_tier(path))
    ns_dir = engine.create_engine_config().kv_transfer.namespace_dir
    hasher_files = _chain_files(ns_dir)
    truncated, corrupt, foreign = hasher_files[0][0], hasher_files[2][1], hasher_files[1][0]
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 100)
    with open(corrupt, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    shutil.copyfile(hasher_files[2][0], foreign)
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"backend": "disk", "path": path, "size_gib": 0.1}}
    ids, cached, _ = _run(tiny_llama_dir, kv_transfer_config=transfer)
    assert ids == oracle
    assert cached == [0, 0, BS]          # prompt 2 keeps its first block, up to the corrupt second one
    for bad in (truncated, corrupt, foreign):
        assert not os.path.exists(bad)
    assert len(_files(path)) == sum(FULL_BLOCKS) - 3


def _chain_files(ns_dir: str) -> list[list[str]]:
    """Each prompt's block files in chain order (depth 0 first), from their hashes."""
    from pagedserve.common.kv_transfer.layout import block_path
    from pagedserve.core.block_hash import BlockHasher
    hasher = BlockHasher(BS)
    chains = []
    for prompt in PROMPTS:
        hashes: list[bytes] = []
        hasher.extend(hashes, prompt)
        chains.append([block_path(ns_dir, key, depth) for depth, key in enumerate(hashes)])
        assert all(os.path.exists(p) for p in chains[-1])
    return chains


def test_tier_stays_within_its_size(tiny_llama_dir, oracle, tmp_path):
    block = 2 * 2 * 2 * BS * 16 * 4         # layers x K,V x kv heads x tokens x head_dim x float32
    size = 3 * (block + 512)                 # three blocks with their headers
    ids, _, _ = _run(tiny_llama_dir, **_tier(str(tmp_path), size_gib=size / (1 << 30)))
    files = _files(str(tmp_path))
    assert ids == oracle and 0 < len(files) <= 3
    assert sum(os.path.getsize(f) for f in files) <= size


def test_write_error_degrades_to_recompute_with_one_warning(tiny_llama_dir, oracle, tmp_path, caplog):
    path = str(tmp_path)
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=128, block_size=BS, **_tier(path)) as llm:
        ns_dir = llm.engine.config.kv_transfer.namespace_dir
        shutil.rmtree(ns_dir)
        with open(ns_dir, "w"):          # a file where the folder was: every write fails
            pass
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
                assert [list(o.outputs[0].token_ids) for o in outs] == oracle
                llm.reset_prefix_cache()
    warnings = [r for r in caplog.records if "KV disk tier" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "saving stops" in warnings[0].getMessage()


def _unwritable_folder(tmp_path) -> str:
    if os.geteuid() != 0:
        folder = tmp_path / "read_only"
        folder.mkdir()
        folder.chmod(0o500)
        return str(folder)
    return "/sys"                            # root writes anywhere a mode allows; sysfs takes no new files


@pytest.mark.parametrize("case", ["missing", "a file", "unwritable"])
def test_unusable_path_is_refused_at_start_naming_the_flag(tiny_llama_dir, tmp_path, case):
    path = {"missing": str(tmp_path / "nowhere"), "a file": str(tmp_path / "f"),
            "unwritable": _unwritable_folder(tmp_path)}[case]
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="--kv-offloading-path"):
        EngineArgs(tiny_llama_dir, **_tier(path)).create_engine_config()
    transfer = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"path": path, "size_gib": 1}}
    with pytest.raises(ValueError, match="kv_transfer_config.kv_connector_extra_config.path"):
        EngineArgs(tiny_llama_dir, kv_transfer_config=transfer).create_engine_config()
