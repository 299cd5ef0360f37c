"""The Ray actor that holds one rank. Imported in the actor's process by Ray (by module path, as any actor
class); it imports no torch until run() builds the Worker."""
from __future__ import annotations

import os

import msgspec


class RayWorker:
    """run() serves the rank until shutdown and so blocks its thread; the actor is started with a second
    thread (max_concurrency=2), on which node_id() and pid() answer whoever asks (tests, operators)."""

    def run(self, launch: bytes) -> int | str:
        """The rank's exit code; or, when it could not start, why (the text of its error reply)."""
        # The launch is our own msgspec JSON: Ray carries the bytes, it never pickles an object of ours.
        from pagedserve.executor.procs.worker_proc import WorkerLaunch, WorkerStartFailed, serve_worker
        try:
            return serve_worker(msgspec.json.decode(launch, type=WorkerLaunch))
        except WorkerStartFailed as failed:
            # run() ending reads as a death to the executor, which may see it before the error reply: the
            # result says why as the reply does, whichever comes first (ray_executor.RayWorkerGroup.dead).
            return failed.error

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()
