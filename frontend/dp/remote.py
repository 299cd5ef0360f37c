"""Multi-node data parallelism, vLLM's flags: a head node serves the API with its local engine cores, and each
headless node (`engine-serve --headless`) starts its own and announces them to the head.

A headless node's cores listen on TCP on this host (ports picked free) with the shared engine token, as any core
with --engine-address does; each announces (rank, input, output) to the head's --data-parallel-address:
--data-parallel-rpc-port, signed with the token (EngineRegistration). The head waits for every remote rank,
drops announcements whose signature fails, and then talks to those cores like to its own (AsyncMPClient).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import time

import msgspec
import zmq

from pagedserve.common import envs
from pagedserve.ipc.messages import EngineRegistration
from pagedserve.ipc.sockets import make_socket

logger = logging.getLogger(__name__)


def _mac(token: str, rank: int, inp: str, out: str) -> str:
    return hmac.new(token.encode(), f"{rank}|{inp}|{out}".encode(), hashlib.sha256).hexdigest()


def rpc_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def advertised_host(head: str) -> str:
    """This host's address as the head reaches it: the one the route to the head leaves from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((head, 9))          # no packet is sent: this only picks the route
        return s.getsockname()[0]


def free_port_pair(host: str) -> int:
    """A port P such that P and P + 1 are both free on `host` now (an engine core binds both)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port + 1))
            except OSError:
                continue
        return port


def announce(head: str, rpc_port: int, token: str, rank: int, inp: str, out: str) -> None:
    """Send one engine's registration to the head (queued by ZeroMQ until the head listens)."""
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, rpc_address(head, rpc_port), zmq.PUSH, bind=False)
    sock.send(msgspec.msgpack.encode(EngineRegistration(rank, inp, out, _mac(token, rank, inp, out))))
    sock.close(linger=int(envs.PAGEDSERVE_STARTUP_TIMEOUT * 1000))


def wait_for_engines(host: str, rpc_port: int, token: str, ranks: set[int]) -> dict[int, tuple[str, str]]:
    """Rank -> (input, output) of every remote engine in `ranks`; TimeoutError naming the missing ranks."""
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, rpc_address(host, rpc_port), zmq.PULL, bind=True, max_msg_bytes=1 << 16)
    found: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + envs.PAGEDSERVE_STARTUP_TIMEOUT
    try:
        while set(found) != ranks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"data-parallel ranks {sorted(ranks - set(found))} never registered at "
                                   f"{rpc_address(host, rpc_port)} (start them with engine-serve --headless)")
            if not sock.poll(200):
                continue
            try:
                reg = msgspec.msgpack.decode(sock.recv(), type=EngineRegistration)
            except msgspec.DecodeError:
                logger.warning("dropped an undecodable data-parallel registration")
                continue
            if not hmac.compare_digest(reg.mac, _mac(token, reg.rank, reg.input, reg.output)):
                logger.warning("dropped a data-parallel registration for rank %d: its signature does not match "
                               "this server's --engine-token", reg.rank)
            elif reg.rank in ranks:
                found[reg.rank] = (reg.input, reg.output)
                logger.info("data-parallel rank %d registered: %s", reg.rank, reg.input)
    finally:
        sock.close(linger=0)
    return found
