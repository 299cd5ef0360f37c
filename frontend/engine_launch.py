"""Starting the engine cores engine-serve talks to: one, N data-parallel ones on this node, the ranks headless
nodes register (multi-node data parallelism), or, with --headless, only this node's ranks for another head."""
from __future__ import annotations

import functools
import logging
import signal
import sys
import time
from collections.abc import Callable

from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.core.engine_core_proc import CoreAddresses
from pagedserve.frontend.client.core_client import AsyncMPClient, CoreHandle
from pagedserve.frontend.client.core_process import CoreProcess
from pagedserve.frontend.dp.client import DataParallelClient
from pagedserve.frontend.dp.remote import advertised_host, announce, free_port_pair, wait_for_engines
from pagedserve.frontend.dp.router import PrefixRouter
from pagedserve.frontend.server_args import ServerArgs

logger = logging.getLogger(__name__)


def check_data_parallel_flags(args: EngineArgs, server: ServerArgs) -> None:
    """ValueError naming the flag where the data-parallel layout cannot work."""
    dp, local = args.data_parallel_size, server.data_parallel_size_local
    if server.enable_elastic_ep and (server.headless or server.engine_address or (local is not None and local < dp)):
        raise ValueError("--enable-elastic-ep starts and stops engine cores on this node, each on sockets of its "
                         "own: it cannot be combined with --headless, --engine-address (one core's sockets) or "
                         "ranks on other nodes (--data-parallel-size-local below --data-parallel-size)")
    if server.data_parallel_backend == "ray":
        for flag, value in (("--headless", server.headless), ("--data-parallel-size-local", local is not None),
                            ("--engine-address", server.engine_address)):
            if value:
                raise ValueError(f"{flag} places engine cores by hand; with --data-parallel-backend ray the Ray "
                                 "cluster places them (leave it out)")
    if local is not None and local > dp:
        raise ValueError(f"--data-parallel-size-local ({local}) exceeds --data-parallel-size ({dp})")
    if dp > 1 and server.engine_address:
        raise ValueError("--engine-address names one engine core's sockets; it cannot be combined with "
                         "--data-parallel-size > 1")
    if server.headless:
        start, count = server.data_parallel_start_rank, local if local is not None else dp
        if not 1 <= start or start + count > dp:
            raise ValueError(f"--headless ranks {start}..{start + count - 1} must lie in 1..{dp - 1} (rank 0 is "
                             "the head's)")
    elif local is not None and local < dp:
        if local < 1:
            raise ValueError("--data-parallel-size-local on the head must be >= 1 (it serves rank 0)")
        if not (server.data_parallel_address and server.engine_token):
            raise ValueError("engines on other nodes need --data-parallel-address (this node's, where they "
                             "register) and --engine-token (shared with them)")


def start_engines(args: EngineArgs, server: ServerArgs, level: int) -> tuple[list[CoreHandle], object]:
    """This node's engine cores and the client over all of them (an AsyncMPClient, or a DataParallelClient for
    data-parallel engines or --restart-engine-on-failure); SystemExit with the core's message if one fails."""
    dp = args.data_parallel_size
    local = server.data_parallel_size_local if server.data_parallel_size_local is not None else dp
    if server.data_parallel_backend == "ray":
        return _start_on_ray(args, server, level)

    def start() -> CoreProcess:
        return CoreProcess(args, level, address=server.engine_address, token=server.engine_token)
    procs = _start_all([start] * local)
    clients = [AsyncMPClient(p.addresses, p.token, p, heartbeat_timeout_s=args.engine_heartbeat_timeout)
               for p in procs]
    if local < dp:
        try:
            remote = wait_for_engines(server.data_parallel_address, server.data_parallel_rpc_port,
                                      server.engine_token, set(range(local, dp)))
        except TimeoutError as exc:
            for proc in procs:
                proc.shutdown()
            sys.exit(f"engine-serve: {exc}")
        clients += [AsyncMPClient(CoreAddresses(input=inp, output=out, handshake=""), server.engine_token,
                                  heartbeat_timeout_s=args.engine_heartbeat_timeout)
                    for _, (inp, out) in sorted(remote.items())]
    if len(clients) == 1 and not (server.restart_engine_on_failure or server.enable_elastic_ep):
        return procs, clients[0]
    info = procs[0].info
    router = PrefixRouter(len(clients), info.block_size, info.num_blocks, server.data_parallel_routing)
    return procs, DataParallelClient(clients, router, restart={i: start for i in range(local)},
                                     start=start if server.enable_elastic_ep else None)


def _start_on_ray(args: EngineArgs, server: ServerArgs, level: int) -> tuple[list[CoreHandle], object]:
    """Every engine core on the Ray cluster; a dead one is started again wherever Ray finds room."""
    from pagedserve.frontend.dp.ray_placement import RayCoreProcess

    def start() -> CoreHandle:
        return RayCoreProcess(args, level, token=server.engine_token)
    procs = _start_all([start] * args.data_parallel_size)
    clients = [AsyncMPClient(p.addresses, p.token, p, heartbeat_timeout_s=args.engine_heartbeat_timeout)
               for p in procs]
    info = procs[0].info
    router = PrefixRouter(len(clients), info.block_size, info.num_blocks, server.data_parallel_routing)
    return procs, DataParallelClient(clients, router, restart={i: start for i in range(len(procs))},
                                     start=start if server.enable_elastic_ep else None)


def serve_headless(args: EngineArgs, server: ServerArgs, level: int) -> None:
    """Start this node's ranks on TCP, register each with the head, and keep them until SIGTERM or one dies."""
    dp = args.data_parallel_size
    count = server.data_parallel_size_local if server.data_parallel_size_local is not None else dp
    host = advertised_host(server.data_parallel_address)
    ports = [free_port_pair("0.0.0.0") for _ in range(count)]
    procs = _start_all([functools.partial(CoreProcess, args, level, address=f"tcp://0.0.0.0:{port}",
                                          token=server.engine_token) for port in ports])
    for i, port in enumerate(ports):
        rank = server.data_parallel_start_rank + i
        announce(server.data_parallel_address, server.data_parallel_rpc_port, server.engine_token, rank,
                 f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}")
        logger.info("data-parallel rank %d at tcp://%s:%d registered with %s", rank, host, port,
                    server.data_parallel_address)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        while not stop and all(p.is_alive() for p in procs):
            time.sleep(0.5)
    finally:
        for proc in procs:
            proc.shutdown()
    if not stop:
        sys.exit("engine-serve --headless: an engine core died")


def _start_all(starters: list[Callable[[], CoreHandle]]) -> list[CoreHandle]:
    """Each core in turn; SystemExit with the core's own message (bad flags, model) if one cannot start."""
    procs: list[CoreHandle] = []
    try:
        for start in starters:
            procs.append(start())
    except (RuntimeError, TimeoutError) as exc:
        for started in procs:
            started.shutdown()
        sys.exit(f"engine-serve: {exc}")
    return procs
