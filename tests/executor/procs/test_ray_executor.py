"""distributed_executor_backend="ray" on real Ray clusters on this machine: ranks as actors in a placement group.

Two Ray nodes (ray.cluster_utils.Cluster: a head and a second raylet, one logical CPU each) carry a TP = 2
model whose ranks land on different nodes, with greedy parity against HF transformers; a local cluster the
engine starts itself carries two pipeline stages; a killed Ray worker is detected as a killed worker process
is; a rank that cannot start says why; a cluster short of room is refused naming the bundle, never a hang."""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import psutil
import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.ray_utils import RAY_NAMESPACE
from pagedserve.executor.procs.ray_executor import RayDistributedExecutor
from pagedserve.frontend.client.core_client import EngineDeadError
from pagedserve.tests.helpers.processes.ray_cluster import two_node_cluster
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, make_tiny_model, random_prompts

PROMPTS = random_prompts(41, [7, 33, 18, 51], 512)
MAX_NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("ray_llama")), arch="llama", tokenizer="synthetic",
                           num_hidden_layers=4)


@pytest.fixture(scope="module")
def hf_want(model) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    return hf_greedy(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def two_nodes():
    """This test process is a driver on the cluster too (to find the engine's actors)."""
    with two_node_cluster() as cluster:
        yield cluster


def _params(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _engine_actors() -> list:
    """The engine's rank actors (named pagedserve-workers-<id>-rank<r>), in rank order."""
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == RAY_NAMESPACE and "-rank" in a["name"])
    return [ray.get_actor(n, namespace=RAY_NAMESPACE) for n in names]


def _llm_on(cluster: Cluster, model: str, monkeypatch, **kw) -> LLM:
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    return LLM(model, dtype="float32", max_num_batched_tokens=32, distributed_executor_backend="ray",
               multiprocess_core=True, **kw)


# First in the file: no cluster of this module's is up yet, so the engine starts one of its own.
def test_local_cluster_carries_pipeline_stages(model, hf_want, monkeypatch):
    """No RAY_ADDRESS: the engine core starts a local Ray cluster for its two stages, and stops it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with LLM(model, dtype="float32", max_num_batched_tokens=32, distributed_executor_backend="ray",
             pipeline_parallel_size=2, multiprocess_core=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]
    assert got == hf_want


def test_tp2_ranks_on_two_nodes_match_hf(two_nodes, model, hf_want, monkeypatch):
    llm = _llm_on(two_nodes, model, monkeypatch, tensor_parallel_size=2,
                  worker_extension_cls="pagedserve.tests.helpers.rl.rl_extension.Probe")
    try:
        actors = _engine_actors()
        assert len(actors) == 2
        nodes = ray.get([a.node_id.remote() for a in actors])
        assert len(set(nodes)) == 2                       # the TP group spans both Ray nodes
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == set(nodes)
        # collective_rpc reaches both actors, kwargs included; a refused call leaves them serving.
        assert llm.collective_rpc("describe_rank", kwargs={"tag": "ray"}) == [
            {"rank": r, "tp_rank": r, "rows": 64, "tag": "ray"} for r in (0, 1)]
        with pytest.raises(ValueError, match="weight_tensor"):
            llm.collective_rpc("weight_tensor")
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == hf_want
    deadline = time.monotonic() + 15                      # the actors end with the engine
    while _engine_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _engine_actors() == []


def test_killed_ray_worker_is_detected(two_nodes, model, monkeypatch):
    llm = _llm_on(two_nodes, model, monkeypatch, tensor_parallel_size=2)
    try:
        rank0, rank1 = _engine_actors()
        pid0, pid1 = ray.get([rank0.pid.remote(), rank1.pid.remote()])
        threading.Timer(1.0, lambda: os.kill(pid1, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises((EngineDeadError, ValueError), match=r"worker rank 1 \(a Ray actor\) died"):
            llm.generate(random_prompts(5, [30] * 8, 512), _params(960), use_tqdm=False)
        assert time.monotonic() - start < 1.0 + 5.0
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 15                      # no orphan: the surviving rank is ended too
    while psutil.pid_exists(pid0) and psutil.Process(pid0).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "rank 0's Ray worker outlived the engine"
        time.sleep(0.2)


def test_ray_rank_that_cannot_start_says_why(two_nodes, model, tmp_path, monkeypatch):
    """A rank that fails to start (a broken checkpoint) is reported with its reason, whether its error reply or
    the end of its actor's run() reaches the executor first; no actor is left."""
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match=r"worker rank [01] failed to start: .*[Ss]afetensor"):
        _llm_on(two_nodes, str(broken), monkeypatch, tensor_parallel_size=2)
    deadline = time.monotonic() + 15
    while _engine_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _engine_actors() == []


def test_cluster_short_of_room_is_refused_naming_the_bundle(two_nodes, model, monkeypatch):
    """Room the cluster does not have: waited for (nodes may join), then an error naming it, not a hang."""
    monkeypatch.setenv("PAGEDSERVE_RAY_PLACEMENT_TIMEOUT", "2")
    config = EngineArgs(model=model, dtype="float32", tensor_parallel_size=4,
                        distributed_executor_backend="ray").create_engine_config()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"cannot place 4 bundle\(s\) of \{'CPU': 1.0\} \(one per rank.*"
                                           r"has \{'CPU': 2.0\} in all.*after waiting 2 s"):
        RayDistributedExecutor(config)
    assert time.monotonic() - start < 2 + 10


def test_busy_cluster_times_out_naming_the_bundle(two_nodes, model, monkeypatch):
    """Room that exists but is held by someone else: a bounded wait, then an error, not a hang."""
    held = placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="SPREAD")
    assert held.wait(timeout_seconds=30)
    monkeypatch.setenv("PAGEDSERVE_RAY_PLACEMENT_TIMEOUT", "2")
    config = EngineArgs(model=model, dtype="float32", tensor_parallel_size=2,
                        distributed_executor_backend="ray").create_engine_config()
    try:
        with pytest.raises(RuntimeError, match=r"did not free 2 bundle\(s\) of \{'CPU': 1.0\} \(one per rank.*"
                                               r"after waiting 2 s"):
            RayDistributedExecutor(config)
    finally:
        remove_placement_group(held)
