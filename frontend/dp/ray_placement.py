"""--data-parallel-backend ray: each data-parallel engine core on a node Ray picks, in a placement group of its own.

A RayEngineHost actor holds the engine's bundle ({"CPU": ranks} or {"GPU": ranks}, all on one node, since the
core's ranks are its child processes) and starts the engine core there exactly as CoreProcess does here: a
`python -m` child fed a CoreLaunch, bound on that node's TCP ports with the engine token. The API server then
talks to it over ZeroMQ like any engine core; Ray carries only our msgspec bytes (the launch, the handshake)
and reports the actor's death. The core dies with its actor (it watches its parent), and its ranks with it.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

import msgspec
import zmq

from pagedserve.common import envs
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.process_utils import ModuleProcess
from pagedserve.common.ray_utils import (RAY_NAMESPACE, actor_resources, connect_ray, export_cluster_address,
                                         forwarded_env, import_ray, place, release, unique_name)
from pagedserve.core.engine_core_main import MODULE as CORE_MAIN, CoreLaunch, class_reference
from pagedserve.core.engine_core_proc import CoreAddresses
from pagedserve.executor.procs.backends import get_executor_class
from pagedserve.frontend.dp.remote import free_port_pair
from pagedserve.ipc.messages import EngineHandshake, EngineStartupFailed
from pagedserve.ipc.serial import MsgpackDecoder
from pagedserve.ipc.sockets import IpcPaths, make_socket

_FLAG = "--data-parallel-backend"
_POLL_MS = 100


class EngineStarted(msgspec.Struct, frozen=True):
    """What the host actor returns from start(): where the core listens, and its handshake's frames."""
    input: str
    output: str
    handshake: list[bytes]


class RayEngineHost:
    """The actor: start() launches the core and returns once it is ready or failed; wait() blocks until it
    exits (the API server's death watch); stop() ends it. Threaded (max_concurrency=4): wait() runs while
    the others answer."""

    def __init__(self) -> None:
        self.proc: ModuleProcess | None = None
        self.paths = IpcPaths("rayhost")

    def start(self, launch_json: bytes) -> bytes:
        ray = import_ray(_FLAG)
        host = ray.util.get_node_ip_address()
        port = free_port_pair("0.0.0.0")
        handshake_addr = self.paths.new("hs")
        launch = msgspec.structs.replace(
            msgspec.json.decode(launch_json, type=CoreLaunch), input=f"tcp://0.0.0.0:{port}",
            output=f"tcp://0.0.0.0:{port + 1}", handshake=handshake_addr, parent_pid=os.getpid(),
            ipc_root=self.paths.root)
        export_cluster_address()     # a core placing its ranks on Ray too joins this cluster
        ctx = zmq.Context.instance()
        sock = make_socket(ctx, handshake_addr, zmq.PULL, bind=True)
        try:
            self.proc = ModuleProcess(CORE_MAIN, msgspec.json.encode(launch), name="pagedserve-engine-core")
            frames = self._handshake(sock)
        finally:
            sock.close(linger=0)
        return msgspec.msgpack.encode(EngineStarted(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}", frames))

    def _handshake(self, sock: zmq.Socket) -> list[bytes]:
        deadline = time.monotonic() + envs.PAGEDSERVE_STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if sock.poll(_POLL_MS):
                return sock.recv_multipart()
            if not self.proc.is_alive():
                failed = EngineStartupFailed(f"engine core process exited during startup (exit code "
                                             f"{self.proc.exitcode})")
                return [msgspec.msgpack.encode(failed)]
        return [msgspec.msgpack.encode(EngineStartupFailed("engine core did not become ready within "
                                                           f"{envs.PAGEDSERVE_STARTUP_TIMEOUT:.0f} s"))]

    def wait(self) -> int:
        while self.proc is not None and self.proc.is_alive():
            self.proc.join(0.5)
        return self.proc.exitcode if self.proc is not None else 0

    def stop(self, timeout_s: float) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout_s)
            self.proc.kill()
            self.proc.join(5)
        self.paths.close()

    def core_pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def node_id(self) -> str:
        return import_ray(_FLAG).get_runtime_context().get_node_id()


class RayCoreProcess:
    """The API server's handle on one engine core on Ray (a CoreHandle, as CoreProcess is)."""

    def __init__(self, engine_args: EngineArgs, log_level: int = logging.INFO, token: str | None = None) -> None:
        self._connected = connect_ray(_FLAG)
        ray = self._ray = import_ray(_FLAG)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.token = token or secrets.token_hex(16)
        self.name = unique_name("engine")
        ranks = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
        bundle = {"GPU": float(ranks)} if engine_args.device == "cuda" else {"CPU": float(ranks)}
        self.group: Any = place([bundle], "STRICT_PACK", "one data-parallel engine core and its ranks", self.name)
        self.paths = IpcPaths("core")       # this side's private folder (engine-serve writes a made-up token there)
        self._closed = False
        try:
            self.actor = ray.remote(max_concurrency=4)(RayEngineHost).options(
                name=self.name, namespace=RAY_NAMESPACE, **actor_resources(bundle),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=0),
                runtime_env={"env_vars": forwarded_env()}).remote()
            launch = CoreLaunch(engine_args=msgspec.to_builtins(engine_args),
                                executor=class_reference(get_executor_class(engine_args.executor_backend())),
                                input="", output="", handshake="", token=self.token, parent_pid=0,
                                log_level=log_level)
            started = msgspec.msgpack.decode(ray.get(self.actor.start.remote(msgspec.json.encode(launch))),
                                             type=EngineStarted)
            msg = MsgpackDecoder(EngineHandshake).decode(started.handshake)
            if isinstance(msg, EngineStartupFailed):
                raise RuntimeError(f"engine core failed to start: {msg.error}")
            self.info = msg.info
            self.addresses = CoreAddresses(input=started.input, output=started.output, handshake="")
            self._exit = self.actor.wait.remote()
        except BaseException:
            self.shutdown()
            raise

    def is_alive(self) -> bool:
        done, _ = self._ray.wait([self._exit], timeout=0)
        return not done

    def death(self) -> str:
        try:
            code = self._ray.get(self._exit, timeout=1.0)
        except Exception as exc:     # the host actor (its node, its process) is gone
            return f"engine core on Ray died with its host actor: {type(exc).__name__}"
        return f"engine core process died (exit code {code}) on Ray"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        actor = getattr(self, "actor", None)
        if actor is not None:
            try:
                self._ray.get(actor.stop.remote(timeout_s), timeout=timeout_s + 10)
            except Exception:      # a dead or stuck host: killing it kills the core (it watches its parent)
                pass
            self._ray.kill(actor)
        release(self.group)
        self.paths.close()
