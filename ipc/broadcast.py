"""Engine core -> workers broadcast: one bounded ZMQ PUSH queue per reader.

A full queue (a worker that stopped reading) raises after a timeout instead of blocking forever,
and oversized messages are refused up front.
"""
from __future__ import annotations

import msgspec
import zmq

from pagedserve.ipc.bound_sockets import BoundSockets
from pagedserve.ipc.curve import CurveClientKeys
from pagedserve.ipc.sockets import make_socket


class BroadcastOverflowError(TimeoutError):
    pass


class BroadcastHandle(msgspec.Struct, array_like=True):
    paths: list[str]
    queue_depth: int
    curve: CurveClientKeys | None = None     # set when the writer is on TCP (readers on other machines)


class BroadcastWriter:
    def __init__(self, num_readers: int, max_message_bytes: int, queue_depth: int = 64,
                 tcp_host: str | None = None) -> None:
        """tcp_host: readers on other machines connect to this address (CURVE-secured) instead of ipc files."""
        self.max_message_bytes = max_message_bytes
        self.queue_depth = queue_depth
        self.bound = BoundSockets("bcast", tcp_host)
        self.sockets = [self.bound.bind(f"r{rank}", zmq.PUSH, hwm=queue_depth) for rank in range(num_readers)]

    def handle(self) -> BroadcastHandle:
        return BroadcastHandle([BoundSockets.address(s) for s in self.sockets], self.queue_depth,
                               self.bound.client_keys)

    def broadcast(self, frames: list, timeout_s: float) -> None:
        size = sum(len(f) if not isinstance(f, memoryview) else f.nbytes for f in frames)
        if size > self.max_message_bytes:
            raise ValueError(f"broadcast message of {size} bytes exceeds the limit of {self.max_message_bytes}")
        for rank, sock in enumerate(self.sockets):
            sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
            try:
                sock.send_multipart(frames, copy=False)
            except zmq.Again:
                raise BroadcastOverflowError(f"broadcast queue to reader {rank} is full: it stopped reading "
                                             f"for {timeout_s} s") from None

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.bound.close()


class BroadcastReader:
    def __init__(self, path: str, queue_depth: int, curve: CurveClientKeys | None = None) -> None:
        self.ctx = zmq.Context()
        # Bounded on this side too: otherwise ZMQ keeps accepting into the reader's queue forever.
        self.sock = make_socket(self.ctx, path, zmq.PULL, bind=False, hwm=queue_depth,
                                secure=curve.secure if curve is not None else None)

    @classmethod
    def connect(cls, handle: BroadcastHandle | bytes, rank: int) -> "BroadcastReader":
        if isinstance(handle, (bytes, bytearray)):
            handle = msgspec.msgpack.decode(handle, type=BroadcastHandle)
        return cls(handle.paths[rank], handle.queue_depth, handle.curve)

    def recv(self, timeout_s: float) -> list:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no broadcast message")
        return self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
