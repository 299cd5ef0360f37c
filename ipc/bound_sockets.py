"""Where one owner's bound sockets live: private ipc:// files on this machine, or TCP with CURVE across machines.

Peers on this machine (a process per rank) reach ipc:// files in a 0700 folder. Peers on other nodes (Ray
workers) reach TCP ports on this node's address instead, and there every socket is a CURVE server that admits
only the client key handed to those peers (ipc/curve.py).
"""
from __future__ import annotations

import zmq

from pagedserve.ipc.curve import CurveClientKeys, CurveServer
from pagedserve.ipc.sockets import IpcPaths, make_socket


class BoundSockets:
    def __init__(self, prefix: str, tcp_host: str | None = None) -> None:
        """tcp_host: bind on this address (its ports chosen by the system) instead of ipc files."""
        self.ctx = zmq.Context()
        self._host = tcp_host
        self._paths = IpcPaths(prefix) if tcp_host is None else None
        self._curve = CurveServer(self.ctx) if tcp_host is not None else None

    @property
    def client_keys(self) -> CurveClientKeys | None:
        """What a connecting peer needs to get in (None for ipc files, which need nothing)."""
        return self._curve.client_keys if self._curve is not None else None

    def bind(self, name: str, socket_type: int, *, hwm: int = 0) -> zmq.Socket:
        if self._paths is not None:
            return make_socket(self.ctx, self._paths.new(name), socket_type, bind=True, hwm=hwm)
        host = f"[{self._host}]" if ":" in self._host else self._host
        return make_socket(self.ctx, f"tcp://{host}:*", socket_type, bind=True, hwm=hwm, secure=self._curve.secure)

    @property
    def root(self) -> str | None:
        """The private folder of the ipc files (None on TCP)."""
        return self._paths.root if self._paths is not None else None

    @staticmethod
    def address(sock: zmq.Socket) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        """After every socket bound here is closed."""
        if self._curve is not None:
            self._curve.close()
        self.ctx.term()
        if self._paths is not None:
            self._paths.close()
