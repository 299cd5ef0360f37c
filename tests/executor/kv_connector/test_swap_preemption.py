"""Swap instead of recompute, whole-chain eviction and the refused host tier, on real engines
(docs/kv_tiers.md). The oracle is the same engine with a pool large enough that nothing is preempted."""
from __future__ import annotations

import glob
import os
import time

import msgspec
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.kv_transfer.layout import block_path, parse_block_name, read_parent
from pagedserve.core.block_hash import BlockHasher
from pagedserve.ipc.messages import SchedulerStats
from pagedserve.tests.helpers.models.tiny_models import random_prompts

BS = 16
# Four prompts of 2-3 full blocks, each growing by 40 tokens: 4 x 6 blocks at the end, in a pool of 12.
PROMPTS = random_prompts(7, [40, 45, 36, 50], 512)
SP = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
TINY_POOL = 12


def _run(model: str, prompts: list[list[int]] = PROMPTS, sp: SamplingParams = SP,
         **kwargs) -> tuple[list[list[int]], SchedulerStats]:
    kwargs.setdefault("max_model_len", 128)
    with LLM(model, dtype="float32", block_size=BS, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = msgspec.convert(llm.client.call_utility("get_stats"), SchedulerStats)
    return [list(o.outputs[0].token_ids) for o in outs], stats


def _tier(path: str, size_gib: float = 0.1) -> dict:
    return {"kv_offloading_backend": "disk", "kv_offloading_size": size_gib, "kv_offloading_path": path}


@pytest.fixture(scope="module")
def unpreempted(tiny_llama_dir) -> list[list[int]]:
    ids, stats = _run(tiny_llama_dir)
    assert stats.num_preemptions == 0
    return ids


def test_a_preempted_request_swaps_its_blocks_back_in_from_the_tier(tiny_llama_dir, unpreempted, tmp_path):
    ids, stats = _run(tiny_llama_dir, num_gpu_blocks_override=TINY_POOL, **_tier(str(tmp_path)))
    assert stats.num_preemptions > 0
    assert ids == unpreempted
    kv = stats.kv_connector_stats
    # Every resumed request loaded its full blocks (counted once they arrived), none came back bad.
    assert kv.swapped_in_tokens >= stats.num_preemptions * BS
    assert kv.swapped_in_tokens % BS == 0 and kv.invalid_blocks == 0
    assert stats.external_prefix_cache_hits >= kv.swapped_in_tokens


def test_a_loaded_request_fits_a_pool_just_its_size(tiny_llama_dir, tmp_path):
    """After its load, a request's loaded tokens are computed, not a prefix hit on top of them: its blocks
    are counted once. Counted twice it asked for 11 blocks of a pool of 7 and never ran (a livelock)."""
    prompt = random_prompts(13, [5 * BS + 3], 512)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reference, _ = _run(tiny_llama_dir, prompt, sp, **_tier(str(tmp_path)))
    ids, stats = _run(tiny_llama_dir, prompt, sp, max_model_len=6 * BS, num_gpu_blocks_override=7,
                      **_tier(str(tmp_path)))
    assert ids == reference and stats.external_prefix_cache_hits == 5 * BS


def test_without_a_tier_a_preempted_request_recomputes(tiny_llama_dir, unpreempted):
    ids, stats = _run(tiny_llama_dir, num_gpu_blocks_override=TINY_POOL)
    assert stats.num_preemptions > 0 and stats.kv_connector_stats is None
    assert ids == unpreempted


def _chain(prompt: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    BlockHasher(BS).extend(hashes, prompt)
    return hashes


def test_a_restart_evicts_whole_chains_never_leaving_an_orphan(tiny_llama_dir, tmp_path):
    """An 7-block chain whose first 4 blocks were saved an hour before the rest (an earlier turn of the
    conversation). Restarted with room for 5 blocks, the oldest block is depth 3, whose children are newer:
    it goes with its whole subtree, and no file is left whose parent is gone."""
    prompt = random_prompts(11, [7 * BS + 3], 512)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    path = str(tmp_path)
    reference, _ = _run(tiny_llama_dir, prompt, sp, **_tier(path))
    files = sorted(glob.glob(os.path.join(path, "*", "*", "*.kvb")))
    assert len(files) == 7
    ns_dir = os.path.dirname(os.path.dirname(files[0]))
    chain = _chain(prompt[0])
    paths = [block_path(ns_dir, key, depth) for depth, key in enumerate(chain[:7])]
    assert all(read_parent(p) == (chain[d - 1] if d else b"") for d, p in enumerate(paths))
    old = time.time() - 3600
    for p in paths[:4]:
        os.utime(p, (old, old))
    block_bytes = os.path.getsize(paths[0])
    ids, stats = _run(tiny_llama_dir, prompt, sp, **_tier(path, size_gib=5.5 * block_bytes / (1 << 30)))
    assert ids == reference
    assert stats.external_prefix_cache_hits == 3 * BS          # depth 0-2 survived; 3-6 went as one subtree
    for f in glob.glob(os.path.join(ns_dir, "*", "*.kvb")):
        key, depth = parse_block_name(os.path.basename(f))
        assert depth == 0 or os.path.exists(block_path(ns_dir, read_parent(f), depth - 1)), f


@pytest.mark.parametrize("how", ["flags", "json"])
def test_the_host_tier_is_refused_on_cpu_with_the_reason(tiny_llama_dir, how):
    if how == "flags":
        kwargs, flag = {"kv_offloading_backend": "native", "kv_offloading_size": 1}, "--kv-offloading-backend"
    else:
        kwargs = {"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                                         "kv_connector_extra_config": {"backend": "native", "size_gib": 1}}}
        flag = "kv_connector_extra_config.backend"
    with pytest.raises(ValueError, match=f"{flag} native: on CPU the KV cache pool already lives in host memory"
                                         r".*--kv-cache-memory.*--kv-offloading-backend disk"):
        EngineArgs(tiny_llama_dir, device="cpu", **kwargs).create_engine_config()
