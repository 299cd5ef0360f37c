"""The engine core in its own process: socket threads around the schedule -> execute -> update loop.

Input thread: recv + auth + decode -> queue -> busy loop -> queue -> output thread: encode + send.
Serialization overlaps model execution, and a stuck client socket never stalls a step.
"""
from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import queue
import signal
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable

import msgspec
import zmq

from pagedserve.common.config.engine_args import CLIENT_EXPIRY_S, CORE_HEARTBEAT_INTERVAL_S, EngineArgs, EngineConfig
from pagedserve.core.engine_core import EngineCore, ExecutorLike
from pagedserve.core.multimodal.received_items import ReceivedItems
from pagedserve.common.process_utils import describe_exception, setup_child_process
from pagedserve.common.throttled_log import ThrottledLog
from pagedserve.ipc.messages import (AbortRequests, EngineCoreInput, EngineCoreOutput, EngineCoreOutputs,
                                     EngineCoreRequest, EngineReady, EngineStartupFailed, UtilityCall,
                                     UtilityResult, refused_output)
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import make_socket

logger = logging.getLogger(__name__)

_POLL_MS = 100
_ANSWERS_KEPT = 256       # recent utility answers kept for resent calls
# Bigger frames are refused by ZeroMQ before they are buffered (the peer is disconnected); a request at
# any max_model_len this engine serves is far smaller.
MAX_INPUT_FRAME_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class CoreAddresses:
    input: str           # ROUTER, clients send [token, *message frames]
    output: str          # ROUTER, clients receive EngineCoreOutputs
    handshake: str       # PUSH from the core to the process that started it


def engine_args_from_json(data: bytes) -> EngineArgs:
    return EngineArgs(**msgspec.json.decode(data))


def run_engine_core(args_json: bytes, executor_class: Callable[[EngineConfig], ExecutorLike],
                    addresses: CoreAddresses, token: str, parent_pid: int, log_level: int = logging.INFO,
                    ipc_root: str | None = None) -> None:
    """Entry point of the engine core process. executor_class: injected by the launcher (the core never
    picks one itself); ipc_root: the folder this core's ipc folders go in."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s")
    setup_child_process("ps-engine-core", parent_pid)
    if ipc_root is not None:
        os.environ["PAGEDSERVE_IPC_ROOT"] = ipc_root     # read through common/envs
    ctx = zmq.Context()
    handshake = make_socket(ctx, addresses.handshake, zmq.PUSH, bind=False)
    encoder = MsgpackEncoder()
    try:
        core = EngineCore.from_engine_args(engine_args_from_json(args_json), executor_class)
    except BaseException as exc:  # the parent needs the reason, whatever it is
        # A ValueError is the user's (a bad flag, an unknown model): the parent prints it, once.
        (logger.debug if isinstance(exc, ValueError) else logger.error)("engine core failed to start: %s", exc)
        handshake.send_multipart(encoder.encode(EngineStartupFailed(error=describe_exception(exc))))
        handshake.close(linger=2000)
        ctx.term()
        raise SystemExit(1)
    proc = EngineCoreProc(core, ctx, addresses, token)
    handshake.send_multipart(encoder.encode(EngineReady(info=core.info())))
    handshake.close(linger=2000)
    code = proc.run()
    raise SystemExit(code)


class EngineCoreProc:
    def __init__(self, core: EngineCore, ctx: zmq.Context, addresses: CoreAddresses, token: str) -> None:
        self.core = core
        self.ctx = ctx
        self.addresses = addresses
        self._token = token.encode()
        self.inputs: queue.Queue[tuple[bytes, EngineCoreInput]] = queue.Queue()
        self.outputs: queue.Queue[tuple[bytes, EngineCoreOutputs] | None] = queue.Queue()
        self.owner: dict[str, bytes] = {}          # request id -> client identity
        self._answered: OrderedDict[tuple[bytes, int, str, bytes], UtilityResult] = OrderedDict()   # recent answers
        # client identity -> when it last sent anything (monotonic); written by the input thread only.
        self.clients: dict[bytes, float] = {}
        self._next_prune = 0.0
        self._stop = threading.Event()
        self._bad_input_log = ThrottledLog(logger)
        mm = core.config.multimodal
        self._items = ReceivedItems(mm.processor_cache_gb if mm is not None else 0.0)
        # Bind before the handshake goes out, so clients can connect as soon as they hear "ready".
        self.input_socket = make_socket(ctx, addresses.input, zmq.ROUTER, bind=True,
                                        max_msg_bytes=MAX_INPUT_FRAME_BYTES)
        self.output_socket = make_socket(ctx, addresses.output, zmq.ROUTER, bind=True)
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        signal.signal(signal.SIGINT, lambda *_: self._stop.set())

    def run(self) -> int:
        threads = [threading.Thread(target=self._input_loop, name="core-input", daemon=True),
                   threading.Thread(target=self._output_loop, name="core-output", daemon=True)]
        for t in threads:
            t.start()
        code = 0
        try:
            self._busy_loop()
        except BaseException as exc:
            code = 1
            reason = f"engine core died: {describe_exception(exc)}"
            logger.error(reason)
            self._fail_everything(reason)
        finally:
            self._stop.set()
            self.outputs.put(None)
            threads[1].join(timeout=5)
            threads[0].join(timeout=1)       # it polls with a timeout, so it sees the stop
            self.core.shutdown()
            self.input_socket.close()
            self.output_socket.close()
        return code

    # ---------------------------------------------------------------- busy loop

    def _busy_loop(self) -> None:
        while not self._stop.is_set():
            self.core.executor.check_health()       # a dead worker surfaces even while idle
            self._drain_inputs(block=not self.core.has_unfinished_requests())
            if self.core.has_unfinished_requests():
                self._send(self.core.step())

    def _drain_inputs(self, block: bool) -> None:
        try:
            item = self.inputs.get(timeout=_POLL_MS / 1000) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.inputs.get_nowait()
            except queue.Empty:
                return

    def _handle(self, client: bytes, msg: EngineCoreInput) -> None:
        if isinstance(msg, EngineCoreRequest):
            self._add_request(client, msg)
        elif isinstance(msg, AbortRequests):
            ids = [rid for rid in msg.request_ids if self.owner.get(rid) == client]
            # Fresh stats too: with nothing left to run, no step would report the change.
            self._send(EngineCoreOutputs(outputs=self.core.abort_requests(ids),
                                         scheduler_stats=self.core.scheduler.make_stats()))
        elif isinstance(msg, UtilityCall):
            self._utility(client, msg)

    def _add_request(self, client: bytes, req: EngineCoreRequest) -> None:
        """The socket's requests are validated here, once (decoding them did not): a refusal names the field."""
        try:
            self.core.add_request(self._items.take(client, req, self.clients))
        except ValueError as exc:
            self.outputs.put((client, EngineCoreOutputs(outputs=[refused_output(req.request_id, exc)])))
            return
        self.owner[req.request_id] = client

    def _utility(self, client: bytes, call: UtilityCall) -> None:
        # A client resends an unanswered call (core_client.UTILITY_RESEND_S); a call that took longer than that
        # (a weight update, sleep) is answered again from here, never run twice. A resend is the same call;
        # another call under a reused id is not one.
        key = (client, call.call_id, call.method, msgspec.msgpack.encode(call.args))
        result = self._answered.get(key)
        if result is None:
            result = UtilityResult(call_id=call.call_id)
            try:
                result.result = self.core.call_utility(call.method, call.args)
            except Exception as exc:    # a client's bad call must not take the core down
                result.error = str(exc)
            self._answered[key] = result
            while len(self._answered) > _ANSWERS_KEPT:
                self._answered.popitem(last=False)
        self.outputs.put((client, EngineCoreOutputs(utility_results=[result])))

    def _send(self, outputs: EngineCoreOutputs) -> None:
        """Route each output to the client that owns its request; stats go to every client."""
        per_client: dict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs.outputs:
            client = self.owner.get(out.request_id)
            if client is None:
                continue
            per_client[client].append(out)
            if out.finish_reason is not None:
                del self.owner[out.request_id]
        for client in self._live_clients() | set(per_client):
            self.outputs.put((client, EngineCoreOutputs(outputs=per_client.get(client, []),
                                                        scheduler_stats=outputs.scheduler_stats)))

    def _live_clients(self) -> set[bytes]:
        """Clients heard from lately (live ones keep alive): stats and beats go to them, not to every
        client that ever connected."""
        now = time.monotonic()
        return {c for c, heard in list(self.clients.items()) if now - heard < CLIENT_EXPIRY_S}

    def _fail_everything(self, reason: str) -> None:
        per_client: dict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        for rid, client in self.owner.items():
            per_client[client].append(EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error",
                                                       error=reason))
        self.owner.clear()
        for client in self._live_clients() | set(per_client):
            self.outputs.put((client, EngineCoreOutputs(outputs=per_client.get(client, []), engine_dead=reason)))

    # ---------------------------------------------------------------- socket threads

    def _input_loop(self) -> None:
        decoder = MsgpackDecoder(EngineCoreInput)
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self.input_socket.recv_multipart(copy=False)
            # Peers may be hostile: every drop is logged, but throttled, so a flood cannot flood the log.
            if len(frames) < 3:
                self._bad_input_log.log("frames", "dropped a message of %d frame(s): a client sends the token "
                                        "and then the message", len(frames) - 1)
                continue
            if not hmac.compare_digest(frames[1].bytes, self._token):
                self._bad_input_log.log("token", "dropped a message with a wrong engine token")
                continue
            client = frames[0].bytes
            try:
                msg = decoder.decode([f.buffer for f in frames[2:]])
            except Exception as exc:   # hostile or corrupt frames must not take the core down
                self._bad_input_log.log("decode", "dropped an undecodable message from a client: %s: %s",
                                        type(exc).__name__, str(exc)[:200])
                continue
            self.clients[client] = time.monotonic()
            self._forget_departed()
            self.inputs.put((client, msg))

    def _forget_departed(self) -> None:
        """Drop expired clients, at most once per expiry period (on the input thread, the only writer)."""
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + CLIENT_EXPIRY_S
        for client in [c for c, heard in self.clients.items() if now - heard >= CLIENT_EXPIRY_S]:
            del self.clients[client]

    def _output_loop(self) -> None:
        """Send queued outputs; beat to every client that got nothing for a heartbeat interval.

        The beats come from this thread, not the busy loop, so a long step still beats (torch releases
        the GIL) while a stopped or dead process falls silent, which is what clients watch for.
        """
        encoder = MsgpackEncoder()
        last_sent: dict[bytes, float] = {}
        next_beat = time.monotonic() + CORE_HEARTBEAT_INTERVAL_S
        while True:
            try:
                item = self.outputs.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                self._flush_remaining(encoder)
                return
            now = time.monotonic()
            if item:
                self._send_frames(encoder, *item)
                last_sent[item[0]] = now
            if now >= next_beat:
                live = self._live_clients()
                for client in live:
                    if now - last_sent.get(client, 0.0) >= CORE_HEARTBEAT_INTERVAL_S:
                        self._send_frames(encoder, client, EngineCoreOutputs())
                        last_sent[client] = now
                for client in [c for c in last_sent if c not in live]:
                    del last_sent[client]
                next_beat = now + CORE_HEARTBEAT_INTERVAL_S

    def _flush_remaining(self, encoder: MsgpackEncoder) -> None:
        while True:
            try:
                item = self.outputs.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._send_frames(encoder, *item)

    def _send_frames(self, encoder: MsgpackEncoder, client: bytes, outputs: EngineCoreOutputs) -> None:
        try:
            self.output_socket.send_multipart([client, *encoder.encode(outputs)], copy=False)
        except zmq.ZMQError as exc:
            logger.warning("could not send outputs to a client: %s", exc)
