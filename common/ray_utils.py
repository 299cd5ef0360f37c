"""Ray, for the parts that place work on a cluster (the Ray executor, data-parallel engines on Ray).

Ray is an optional dependency (`pip install 'pagedserve[ray]'`), imported only when a Ray backend is chosen.
Everything here is Ray's own machinery: its cluster, placement groups and actors; we add the bound that turns
a cluster without room into an error naming the bundle, instead of a placement that waits forever.
"""
from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from pagedserve.common import envs

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "pagedserve"
# Variables our processes need from the launcher's environment: an existing cluster's workers start with
# the cluster's own environment, not ours.
_FORWARDED_ENV_PREFIXES = ("PAGEDSERVE_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "NCCL_", "GLOO_", "TRITON_")


def import_ray(flag: str) -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"{flag} ray needs Ray: pip install 'pagedserve[ray]'") from None
    return ray


def connect_ray(flag: str) -> bool:
    """Join the cluster at RAY_ADDRESS (else one `ray start` began on this machine, else a new local one, as
    ray.init() decides); True when this call connected, so the caller disconnects at the end."""
    ray = import_ray(flag)
    if ray.is_initialized():
        return False
    local = envs.RAY_ADDRESS is None
    ray.init(namespace=RAY_NAMESPACE, **({"include_dashboard": False} if local else {}))
    return True


def cluster_has_gpus() -> bool:
    """Whether the cluster the Ray backend will join has GPUs (connecting to it, as the executor will)."""
    connect_ray("distributed_executor_backend=")
    return import_ray("a Ray backend").cluster_resources().get("GPU", 0.0) > 0


def export_cluster_address() -> None:
    """In an actor: the processes it starts (an engine core, which may place ranks on Ray) join its cluster
    rather than start one of their own."""
    os.environ["RAY_ADDRESS"] = import_ray("a Ray backend").get_runtime_context().gcs_address


def forwarded_env() -> dict[str, str]:
    """A runtime_env's env_vars for our actors."""
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}


def actor_resources(bundle: dict[str, float]) -> dict[str, float]:
    """An actor's num_cpus / num_gpus for a bundle it fills."""
    return {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0)}


def unique_name(kind: str) -> str:
    """A name for a placement group and its actors (tests and operators find them by it)."""
    return f"pagedserve-{kind}-{uuid.uuid4().hex[:8]}"


def place(bundles: list[dict[str, float]], strategy: str, what: str, name: str) -> Any:
    """A ready placement group named name, or RuntimeError naming the bundles after
    PAGEDSERVE_RAY_PLACEMENT_TIMEOUT seconds. A cluster short of room is waited for too, not refused at once:
    nodes may still be joining (a LeaderWorkerSet's workers, an autoscaler answering this very request)."""
    ray = import_ray("a Ray backend")
    from ray.util.placement_group import placement_group, remove_placement_group
    timeout_s = envs.PAGEDSERVE_RAY_PLACEMENT_TIMEOUT
    if (short := _shortfall(ray, bundles, strategy, what)) is not None:
        logger.warning("%s; waiting up to %g s for nodes to join (PAGEDSERVE_RAY_PLACEMENT_TIMEOUT)", short, timeout_s)
    group = placement_group(bundles, strategy=strategy, name=name)
    if not group.wait(timeout_seconds=timeout_s):
        remove_placement_group(group)
        why = _shortfall(ray, bundles, strategy, what) or f"the Ray cluster did not free {_bundles(bundles)} ({what})"
        raise RuntimeError(f"{why}, after waiting {timeout_s:g} s (PAGEDSERVE_RAY_PLACEMENT_TIMEOUT); available "
                           f"now: {_shown(ray.available_resources())}")
    return group


def release(group: Any) -> None:
    ray = import_ray("a Ray backend")
    if group is not None and ray.is_initialized():
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(group)


def _shortfall(ray: Any, bundles: list[dict[str, float]], strategy: str, what: str) -> str | None:
    """Why the cluster as it stands can never hold the bundles, or None when it could."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    totals: dict[str, float] = {}
    for res in nodes:
        for key, value in res.items():
            totals[key] = totals.get(key, 0.0) + value
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0.0) + value
    short = any(totals.get(k, 0.0) < v for k, v in need.items())
    unplaceable = [b for b in bundles if not any(all(res.get(k, 0.0) >= v for k, v in b.items()) for res in nodes)]
    one_node = strategy == "STRICT_PACK"
    if not (short or unplaceable or (one_node and not any(all(res.get(k, 0.0) >= v for k, v in need.items())
                                                          for res in nodes))):
        return None
    return (f"the Ray cluster cannot place {_bundles(bundles)} ({what}{', all on one node' if one_node else ''}): "
            f"it has {_shown(totals)} in all, the largest node {_shown(_largest(nodes))}")


def _largest(nodes: list[dict[str, float]]) -> dict[str, float]:
    return max(nodes, key=lambda r: (r.get("GPU", 0.0), r.get("CPU", 0.0)), default={})


def _bundles(bundles: list[dict[str, float]]) -> str:
    return f"{len(bundles)} bundle(s) of {bundles[0]}" if all(b == bundles[0] for b in bundles) else str(bundles)


def _shown(res: dict[str, float]) -> str:
    shown = {k: v for k, v in res.items() if k in ("CPU", "GPU")}
    return str(shown or "no CPU or GPU")
