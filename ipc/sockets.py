"""ZeroMQ socket helpers: unique ipc paths per engine instance, tcp ports, sane options."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable

import zmq

from pagedserve.common import envs

# Set by the engine core process for itself and its workers: their ipc folders nest inside the folder of
# the process that started the core, so removing that one folder removes them even after a SIGKILL.


class IpcPaths:
    """A private temp folder holding one engine instance's ipc socket files; removed on close."""

    def __init__(self, prefix: str) -> None:
        # Short: unix socket paths are limited to 107 bytes. mkdtemp makes it 0700: only this user connects.
        parent = envs.PAGEDSERVE_IPC_ROOT
        if parent is not None and not os.path.isdir(parent):
            parent = None
        self.root = tempfile.mkdtemp(prefix=f"ps-{prefix}-{uuid.uuid4().hex[:6]}-", dir=parent)

    def new(self, name: str) -> str:
        return f"ipc://{os.path.join(self.root, name)}"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "IpcPaths":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_socket(ctx: zmq.Context, path: str, socket_type: int, bind: bool, *, identity: bytes | None = None,
                linger: int = 0, hwm: int = 0, max_msg_bytes: int = -1,
                secure: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
    """hwm=0: unbounded queues, the default for request/response paths whose callers bound them.
    max_msg_bytes: a peer sending a bigger frame is disconnected (-1: no limit).
    secure: sets security options (ipc/curve.py) before the bind or connect."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    sock.setsockopt(zmq.LINGER, linger)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if path.startswith("tcp://[") or path.startswith("tcp://::"):
        sock.setsockopt(zmq.IPV6, 1)
    if path.startswith("ipc://"):
        sock.setsockopt(zmq.SNDBUF, 8 << 20)
        sock.setsockopt(zmq.RCVBUF, 8 << 20)
    if secure is not None:
        secure(sock)
    if bind:
        sock.bind(path)
    else:
        sock.connect(path)
    return sock


def cleanup_ipc_path(path: str) -> None:
    if path.startswith("ipc://"):
        try:
            os.unlink(path[len("ipc://"):])
        except FileNotFoundError:
            pass
