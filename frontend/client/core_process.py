"""The engine core's process: start it with its launch settings, wait for its handshake, supervise and stop
it. A failed start surfaces as the child's own message as soon as it reports it or dies."""
from __future__ import annotations

import logging
import os
import secrets
import time

import msgspec
import zmq

from pagedserve.common import envs
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.process_utils import ModuleProcess, stop_at_exit
from pagedserve.core.engine_core_main import MODULE as CORE_MAIN, CoreLaunch, class_reference
from pagedserve.core.engine_core_proc import CoreAddresses
from pagedserve.executor.procs.backends import get_executor_class
from pagedserve.ipc.messages import EngineHandshake, EngineReady, EngineStartupFailed
from pagedserve.ipc.serial import MsgpackDecoder
from pagedserve.ipc.sockets import IpcPaths, cleanup_ipc_path, make_socket

_POLL_MS = 100           # how often the handshake wait looks at the child while it starts


def split_engine_address(address: str) -> tuple[str, str]:
    """One user-facing engine address -> the core's (input, output) socket addresses."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ValueError(f"engine address {address!r} must look like tcp://HOST:PORT")
        return address, f"tcp://{host}:{int(port) + 1}"
    if address.startswith("ipc://"):
        return address, address + "-out"
    raise ValueError(f"engine address {address!r} must start with ipc:// or tcp://")


class CoreProcess:
    """Starts the engine core in a child process and waits for its handshake.

    A failed start surfaces as an exception carrying the child's own message, as soon as the child
    reports it or dies, not after a timeout.
    """

    def __init__(self, engine_args: EngineArgs, log_level: int = logging.INFO, address: str | None = None,
                 token: str | None = None) -> None:
        self.paths = IpcPaths("core")
        inp, out = split_engine_address(address) if address else (self.paths.new("in"), self.paths.new("out"))
        self.addresses = CoreAddresses(input=inp, output=out, handshake=self.paths.new("hs"))
        self.token = token or secrets.token_hex(16)
        ctx = zmq.Context.instance()
        handshake = make_socket(ctx, self.addresses.handshake, zmq.PULL, bind=True)
        # The launcher picks the executor and injects it; the class travels by reference (module + name).
        launch = CoreLaunch(engine_args=msgspec.to_builtins(engine_args),
                            executor=class_reference(get_executor_class(engine_args.executor_backend())),
                            input=inp, output=out, handshake=self.addresses.handshake, token=self.token,
                            parent_pid=os.getpid(), log_level=log_level, ipc_root=self.paths.root)
        self._closed = False
        self.proc = ModuleProcess(CORE_MAIN, msgspec.json.encode(launch), name="pagedserve-engine-core")
        self._cancel_exit_hook = stop_at_exit(self, lambda proc: proc.shutdown())
        try:
            self.info = self._wait_ready(handshake).info
        except BaseException:
            self.shutdown()
            raise
        finally:
            handshake.close(linger=0)

    def _wait_ready(self, sock: zmq.Socket) -> EngineReady:
        decoder = MsgpackDecoder(EngineHandshake)
        timeout_s = envs.PAGEDSERVE_STARTUP_TIMEOUT
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(_POLL_MS):
                msg = decoder.decode(sock.recv_multipart())
                if isinstance(msg, EngineStartupFailed):
                    raise RuntimeError(f"engine core failed to start: {msg.error}")
                return msg
            if not self.proc.is_alive():
                raise RuntimeError(f"engine core process exited during startup (exit code {self.proc.exitcode})")
        raise TimeoutError(f"engine core did not become ready within {timeout_s:.0f} s")

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def death(self) -> str:
        """Why a core that is no longer alive ended."""
        return f"engine core process died (exit code {self.proc.exitcode})"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (it stops its workers first); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._cancel_exit_hook()
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        # A core that was killed could not unbind: its sockets' files go here, its workers' with paths.
        cleanup_ipc_path(self.addresses.input)
        cleanup_ipc_path(self.addresses.output)
        self.proc.close()
        self.paths.close()
