"""The Ray actor that holds one rank. Imported in the actor's process by Ray (by module path, as any actor
class); it imports no torch until run() builds the Worker."""
from __future__ import annotations

import os
import time

import msgspec


class RayWorker:
    """run() serves the rank until shutdown and so blocks its thread; the actor is started with a second
    thread (max_concurrency=2), on which node_id() and pid() answer whoever asks (tests, operators)."""

    def run(self, launch: bytes) -> int:
        # The launch is our own msgspec JSON: Ray carries the bytes, it never pickles an object of ours.
        from pagedserve.executor.procs.worker_proc import WorkerLaunch, serve_worker
        try:
            return serve_worker(msgspec.json.decode(launch, type=WorkerLaunch))
        except SystemExit as failed:      # the rank could not start: its error reply is on the way
            # run() ending reads as a death to the executor: let the error reply, which says why, reach it first.
            time.sleep(2.0)
            return failed.code if isinstance(failed.code, int) else 1

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()
