"""Worker liveness beyond process death: every worker process beats, the executor watches the beats.

A SIGSTOPped or wedged worker is still alive, so its process sentinel never fires. Its heartbeat comes
from a thread of its own: a long step keeps beating (the GIL is released in torch ops and switched every
few ms otherwise), a stopped process does not.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from pagedserve.common.throttled_log import ThrottledLog
from pagedserve.ipc.messages import WorkerHeartbeat
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import make_socket

logger = logging.getLogger(__name__)
_bad_beat_log = ThrottledLog(logger)


def heartbeat_interval(timeout_s: float) -> float:
    """Several beats per timeout, so one late beat is never mistaken for a hang."""
    return min(1.0, max(0.05, timeout_s / 5))


def start_heartbeat_sender(ctx: zmq.Context, address: str, rank: int, interval_s: float,
                           secure: Callable[[zmq.Socket], None] | None = None) -> None:
    """Worker side: a daemon thread that sends WorkerHeartbeat(rank) every interval_s.

    It beats until the process exits; nothing stops it earlier, since a worker that stops beating
    while alive would be taken for a hung one.
    """
    threading.Thread(target=_send_beats, args=(ctx, address, rank, interval_s, secure), name="worker-heartbeat",
                     daemon=True).start()


def _send_beats(ctx: zmq.Context, address: str, rank: int, interval_s: float,
                secure: Callable[[zmq.Socket], None] | None) -> None:
    # A few queued beats at most: a stalled core needs to know a worker is alive, not how often.
    sock = make_socket(ctx, address, zmq.PUSH, bind=False, hwm=4, secure=secure)
    frames = MsgpackEncoder().encode(WorkerHeartbeat(rank))
    while True:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        time.sleep(interval_s)


class HeartbeatWatch:
    """Executor side: when each rank last beat; which rank, if any, is past the timeout."""

    def __init__(self, sock: zmq.Socket, world_size: int, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.decoder = MsgpackDecoder(WorkerHeartbeat)
        self.last = [time.monotonic()] * world_size

    def drain(self) -> None:
        """Take every beat waiting on the socket (beats carry no timestamp: arrival is what counts)."""
        now = time.monotonic()
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            try:
                rank = self.decoder.decode(frames).rank
            except Exception as exc:   # the socket file is private, but a bad frame must not stop the watch
                _bad_beat_log.log("decode", "dropped an undecodable heartbeat frame: %s", type(exc).__name__)
                continue
            if 0 <= rank < len(self.last):
                self.last[rank] = now

    def seconds_left(self) -> float:
        return min(self.last) + self.timeout_s - time.monotonic()

    def silent_rank(self) -> tuple[int, float] | None:
        """(rank, seconds since its last beat) for the longest-silent rank past the timeout, else None."""
        now = time.monotonic()
        rank = min(range(len(self.last)), key=self.last.__getitem__)
        silent = now - self.last[rank]
        return (rank, silent) if silent > self.timeout_s else None
