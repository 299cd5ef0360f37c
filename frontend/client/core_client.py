"""Clients of an engine core process (core_process.py starts it): send requests, receive outputs, watch its
liveness."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from pagedserve.common.config.engine_args import CLIENT_KEEPALIVE_S, CORE_HEARTBEAT_INTERVAL_S, EngineArgs
from pagedserve.core.engine_core_proc import CoreAddresses
from pagedserve.ipc.messages import AbortRequests, EngineCoreOutputs, EngineCoreRequest, UtilityCall, UtilityResult
from pagedserve.ipc.mm_mirror import MISSING_ITEM, ItemMirror
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import make_socket

logger = logging.getLogger(__name__)

_POLL_MS = 100
# A utility call is re-sent this often until answered (_ClientBase._attempts): the core's output socket drops
# replies to a peer it has not seen yet, so the first call of a new client may be lost (the repeat is
# harmless: calls are reads or idempotent).
UTILITY_RESEND_S = 0.5


class EngineDeadError(RuntimeError):
    """The engine core (or one of its workers) died; no request can complete."""


class UtilityError(ValueError):
    """The engine core refused a utility call (a bad argument, an adapter it cannot serve): its message."""


class CoreHandle(Protocol):
    """A started engine core a client watches and stops: a CoreProcess here, or one on Ray (dp_ray.py)."""
    addresses: CoreAddresses
    token: str
    info: Any

    def is_alive(self) -> bool: ...
    def death(self) -> str: ...
    def shutdown(self, timeout_s: float = 10.0) -> None: ...


class EngineCoreClient(Protocol):
    """What LLM drives, whether the core runs in this process (InprocClient) or in its own (SyncMPClient).
    AsyncMPClient has the same calls, awaitable, and shares SyncMPClient's protocol code (_ClientBase)."""

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs | None: ...
    def call_utility(self, method: str, *args: Any) -> Any: ...
    def close(self) -> None: ...


class _ClientBase:
    """The protocol with an engine core process, for both clients: frames with the token, liveness (process,
    heartbeats, keepalive), routing utility answers to their callers, and the one utility resend loop. The
    subclasses only do the socket I/O, blocking or awaited."""

    def __init__(self, addresses: CoreAddresses, token: str, proc: CoreHandle | None,
                 heartbeat_timeout_s: float) -> None:
        self.addresses = addresses
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._heard_at: float | None = None       # None until the core first answers: it beats after that
        self._listened_at = 0.0                   # when this client last polled for outputs
        self._sent_at = time.monotonic()
        self.token = token.encode()
        self.proc = proc
        self.identity = uuid.uuid4().bytes
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.dead: str | None = None
        self._call_ids = itertools.count()
        # Utility calls awaiting their answer: call id -> a future (concurrent or asyncio: the same face).
        self._calls: dict[int, Any] = {}
        self.mm_cache_gb = 0.0
        self.mm_mirror: ItemMirror | None = None     # what the core holds of the items sent (use_mm_cache)

    def use_mm_cache(self, gib: float) -> None:
        """Send an item's processed tensors only when the core does not hold them (the core's
        --mm-processor-cache-gb, which this budget must equal)."""
        self.mm_cache_gb = gib
        self.mm_mirror = ItemMirror.of_gb(gib, keep_data=False)

    def _outgoing(self, request: EngineCoreRequest) -> EngineCoreRequest:
        if self.mm_mirror is None or not request.mm_features:
            return request
        return msgspec.structs.replace(request, mm_features=self.mm_mirror.strip(request.mm_features))

    def _frames(self, msg: Any) -> list:
        self._sent_at = time.monotonic()
        return [self.token, *self.encoder.encode(msg)]

    def _keepalive(self) -> list | None:
        """The frames of a ping when this client has sent nothing for CLIENT_KEEPALIVE_S: the core sends
        stats and beats only to clients it has heard from lately."""
        if time.monotonic() - self._sent_at < CLIENT_KEEPALIVE_S:
            return None
        return self._frames(UtilityCall(next(self._call_ids), "ping"))

    def _check_alive(self) -> None:
        if self.dead is None and self.proc is not None and not self.proc.is_alive():
            self.dead = self.proc.death()
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def _check_silence(self) -> None:
        """Called when a poll found nothing: a core silent past the timeout is stopped, hung or gone
        (a killed core that is not our child, or one on another host, is only noticed this way)."""
        now = time.monotonic()
        if self._heard_at is not None and now - self._listened_at > 2 * CORE_HEARTBEAT_INTERVAL_S:
            self._heard_at = now      # nobody listened in between (e.g. an idle LLM): the clock starts now
        self._listened_at = now
        if self.dead is None and self._heard_at is not None:
            silent = now - self._heard_at
            if silent > self.heartbeat_timeout_s:
                self.dead = (f"the engine core at {self.addresses.input} sent nothing for {silent:.0f} s "
                             f"(engine heartbeat timeout {self.heartbeat_timeout_s:g} s): it is stopped, "
                             "hung or unreachable")
        self._check_alive()

    def _start_call(self, method: str, args: tuple[Any, ...], answer: Any) -> UtilityCall:
        """A utility call whose UtilityResult will be set on `answer` (a future) when it arrives."""
        call = UtilityCall(next(self._call_ids), method, list(args))
        self._calls[call.call_id] = answer
        return call

    def _attempts(self, method: str, timeout_s: float) -> Iterator[float]:
        """The utility-call resend loop: before each (re)send of the call it checks that the core lives, and
        yields how long to wait for the answer; TimeoutError once timeout_s passed unanswered."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._check_alive()
            yield min(left, UTILITY_RESEND_S)
        raise TimeoutError(f"no answer to {method!r} from the engine core at {self.addresses.input} within "
                           f"{timeout_s:g} s (wrong address or token?)")

    @staticmethod
    def _unwrap(result: UtilityResult) -> Any:
        if result.error:
            raise UtilityError(result.error)
        return result.result

    def _receive(self, frames: list) -> EngineCoreOutputs:
        """Decode what the core sent; answers go to the calls awaiting them."""
        self._heard_at = self._listened_at = time.monotonic()
        outputs = self.decoder.decode(frames)
        if outputs.engine_dead:
            self.dead = outputs.engine_dead
        if self.mm_mirror is not None and any(MISSING_ITEM in (o.error or "") for o in outputs.outputs):
            self.mm_mirror.clear()              # the core lost our items and started over: so do we
        for result in outputs.utility_results:
            answer = self._calls.get(result.call_id)
            if answer is not None and not answer.done():
                answer.set_result(result)
        return outputs

    @staticmethod
    def _carries(outputs: EngineCoreOutputs) -> bool:
        """Whether outputs hold anything for get_output's reader (not only answers, or a heartbeat)."""
        return bool(outputs.outputs or outputs.scheduler_stats is not None or outputs.engine_dead)


class SyncMPClient(_ClientBase):
    """Blocking client (offline LLM)."""

    def __init__(self, addresses: CoreAddresses, token: str, proc: CoreHandle | None = None,
                 heartbeat_timeout_s: float = EngineArgs.engine_heartbeat_timeout) -> None:
        super().__init__(addresses, token, proc, heartbeat_timeout_s)
        ctx = zmq.Context.instance()
        self.input = make_socket(ctx, addresses.input, zmq.DEALER, bind=False, identity=self.identity)
        self.output = make_socket(ctx, addresses.output, zmq.DEALER, bind=False, identity=self.identity)
        self._pending: list[EngineCoreOutputs] = []
        self._wait_connected()

    def _wait_connected(self, timeout_s: float = 30.0) -> None:
        try:
            self.call_utility("ping", timeout_s=timeout_s)
        except TimeoutError:
            raise TimeoutError(f"could not reach the engine core at {self.addresses.input} within {timeout_s} s") \
                from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.input.send_multipart(self._frames(self._outgoing(request)), copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self.input.send_multipart(self._frames(AbortRequests(request_ids)), copy=False)

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        """The next message from the core (heartbeats too: an idle caller sees the core is alive), or None
        after timeout_s."""
        if self._pending:
            return self._pending.pop(0)
        return self._recv(timeout_s)

    def _recv(self, timeout_s: float | None) -> EngineCoreOutputs | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            self._check_alive()
            if (ping := self._keepalive()) is not None:
                self.input.send_multipart(ping, copy=False)
            if self.output.poll(_POLL_MS if deadline is None else
                                max(1, min(_POLL_MS, int((deadline - time.monotonic()) * 1000)))):
                return self._receive(self.output.recv_multipart(copy=False))
            self._check_silence()
        return None

    def call_utility(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        answer: Future = Future()
        call = self._start_call(method, args, answer)
        try:
            for wait_s in self._attempts(method, timeout_s):
                self.input.send_multipart(self._frames(call), copy=False)
                self._read_until(answer, time.monotonic() + wait_s)
                if answer.done():
                    return self._unwrap(answer.result())
        finally:
            self._calls.pop(call.call_id, None)

    def _read_until(self, answer: Future, deadline: float) -> None:
        """Read from the core until the answer is in or the deadline passes; what else came (request outputs,
        stats) is kept for get_output."""
        while not answer.done() and (left := deadline - time.monotonic()) > 0:
            out = self._recv(timeout_s=left)
            if out is not None and self._carries(out):
                self._pending.append(out)

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        if self.proc is not None:
            self.proc.shutdown()


class AsyncMPClient(_ClientBase):
    """asyncio client (AsyncEngineClient). One reader task owns the output socket: it answers utility calls
    and queues everything else for `get_output`, so a utility call works before, during and without a
    consumer of request outputs."""

    def __init__(self, addresses: CoreAddresses, token: str, proc: CoreHandle | None = None,
                 heartbeat_timeout_s: float = EngineArgs.engine_heartbeat_timeout) -> None:
        super().__init__(addresses, token, proc, heartbeat_timeout_s)
        self.ctx = zmq.asyncio.Context()
        self.input = make_socket(self.ctx, addresses.input, zmq.DEALER, bind=False, identity=self.identity)
        self.output = make_socket(self.ctx, addresses.output, zmq.DEALER, bind=False, identity=self.identity)
        self._reader: asyncio.Task | None = None
        self._outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        # Shielded: the mirror counts the items as sent, so the send must finish even if the caller is cancelled.
        await asyncio.shield(self.input.send_multipart(self._frames(self._outgoing(request)), copy=False))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            await self.input.send_multipart(self._frames(AbortRequests(request_ids)), copy=False)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        self._ensure_reader()
        answer = asyncio.get_running_loop().create_future()
        call = self._start_call(method, args, answer)
        try:
            for wait_s in self._attempts(method, timeout_s):
                await self.input.send_multipart(self._frames(call), copy=False)
                done, _ = await asyncio.wait({answer}, timeout=wait_s)
                if done:
                    return self._unwrap(answer.result())
        finally:
            self._calls.pop(call.call_id, None)

    async def get_output(self) -> EngineCoreOutputs:
        """The next outputs that carry anything; EngineDeadError once the core is dead or silent."""
        self._ensure_reader()
        assert self._outputs is not None
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)      # every later caller sees it too
            raise item
        return item

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._outputs = asyncio.Queue()
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        assert self._outputs is not None
        try:
            while True:
                self._check_alive()
                if (ping := self._keepalive()) is not None:
                    await self.input.send_multipart(ping, copy=False)
                if not await self.output.poll(_POLL_MS):
                    self._check_silence()
                    continue
                outputs = self._receive(await self.output.recv_multipart(copy=False))
                if self._carries(outputs):
                    self._outputs.put_nowait(outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:   # dead, silent, or a bug here: every waiter must hear of it
            error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine client failed: {exc}")
            self._outputs.put_nowait(error)
            for answer in self._calls.values():
                if not answer.done():
                    answer.set_exception(error)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        if self.proc is not None:
            self.proc.shutdown()
