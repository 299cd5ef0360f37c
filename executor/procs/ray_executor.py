"""distributed_executor_backend="ray": every rank a Ray actor in one placement group, possibly on other nodes.

Ray places and starts the workers and tells us when one dies; everything else is the multiprocess executor's:
steps go out as msgspec over ZeroMQ (TCP, CURVE-secured, since ranks may sit on other machines), and the
ranks' tensors move through torch.distributed (gloo on CPU, NCCL on GPU), rendezvousing at this node.
"""
from __future__ import annotations

from typing import Any

import msgspec

from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.common.ray_utils import (RAY_NAMESPACE, actor_resources, connect_ray, forwarded_env, import_ray,
                                         place, release, unique_name)
from pagedserve.executor.procs.multiproc_executor import MultiProcExecutor, WorkerGroup
from pagedserve.executor.procs.worker_proc import WorkerLaunch

_FLAG = "distributed_executor_backend="


class RayWorkerGroup(WorkerGroup):
    """One RayWorker actor per rank, in its rank's bundle; a rank is dead when its run() call ends."""

    def __init__(self, launches: list[WorkerLaunch], group: Any, bundle: dict[str, float], name: str) -> None:
        ray = self._ray = import_ray(_FLAG)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedserve.executor.procs.ray_worker import RayWorker
        actor_class = ray.remote(max_concurrency=2)(RayWorker)
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        for launch in launches:
            actor = actor_class.options(
                name=f"{name}-rank{launch.rank}", namespace=RAY_NAMESPACE, **actor_resources(bundle),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=launch.rank),
                runtime_env={"env_vars": forwarded_env()}).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(msgspec.json.encode(launch)))

    def wake_fds(self) -> list[int]:
        return []

    def dead(self) -> str | None:
        done, _ = self._ray.wait(self.runs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.runs.index(done[0])
        try:
            result = self._ray.get(done[0], timeout=1.0)
        except Exception as exc:     # RayActorError and kin: the actor's process is gone
            return f"worker rank {rank} (a Ray actor) died: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        if isinstance(result, str):  # RayWorker.run: the rank could not start (as its error reply says)
            return f"worker rank {rank} failed to start: {result}"
        return f"worker rank {rank} (a Ray actor) exited (exit code {result})"

    def wait_for_death(self, timeout_s: float) -> None:
        self._ray.wait(self.runs, num_returns=1, timeout=timeout_s)

    def stop(self, graceful: bool) -> None:
        if graceful:
            self._ray.wait(self.runs, num_returns=len(self.runs), timeout=5.0)
        for actor in self.actors:
            self._ray.kill(actor)


class RayDistributedExecutor(MultiProcExecutor):
    """Bundles of {"CPU": 1} per rank on CPU, {"GPU": 1} on CUDA, packed onto as few nodes as have room."""

    def __init__(self, config: EngineConfig) -> None:
        # Before any socket or thread: a cluster that cannot hold the ranks fails first.
        self._connected = connect_ray(_FLAG)
        ray = import_ray(_FLAG)
        self.node_ip: str = ray.util.get_node_ip_address()
        self.bundle = {"GPU": 1.0} if config.model.device == "cuda" else {"CPU": 1.0}
        self.group: Any = None
        self.name = unique_name("workers")
        try:
            self.group = place([dict(self.bundle)] * config.parallel.world_size, "PACK",
                               "one per rank: tensor_parallel_size x pipeline_parallel_size", self.name)
            super().__init__(config)
        except BaseException:
            self._release()
            raise

    def _tcp_host(self) -> str | None:
        return self.node_ip

    def _spawn(self, launches: list[WorkerLaunch]) -> WorkerGroup:
        return RayWorkerGroup(launches, self.group, self.bundle, self.name)

    def _release(self) -> None:
        group, self.group = self.group, None
        release(group)
        if self._connected:
            import_ray(_FLAG).shutdown()
            self._connected = False

    def shutdown(self) -> None:
        super().shutdown()
        self._release()
