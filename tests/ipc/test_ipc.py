"""ipc/: message round trips, one frame per message, no tensors, no pickle, sockets, broadcast."""
from __future__ import annotations

import multiprocessing
import pathlib
import subprocess
import sys
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.ipc import messages as m
from pagedserve.ipc.broadcast import BroadcastOverflowError, BroadcastReader, BroadcastWriter
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import IpcPaths, free_tcp_port, make_socket

PARAMS = SamplingParams(temperature=0.7, top_p=0.9, seed=5, stop=["\n\n", "END"], logprobs=2, max_tokens=30)


def roundtrip(obj: Any, typ: Any) -> Any:
    return MsgpackDecoder(typ).decode(MsgpackEncoder().encode(obj))


MESSAGES = [
    (m.EngineCoreRequest("r1", [1, 2, 3], PARAMS, 12.5, priority=2, client_index=1), m.EngineCoreInput),
    (m.AbortRequests(["a", "b"]), m.EngineCoreInput),
    (m.UtilityCall(3, "ping", [1, "x", None]), m.EngineCoreInput),
    (m.EngineCoreOutputs(
        outputs=[m.EngineCoreOutput("r1", [5], "stop", 7, [m.LogprobsEntry([5, 6], [-0.1, -2.0], 1)], 16)],
        scheduler_stats=m.SchedulerStats(3, 1, 0.25, 100, 48, 2),
        utility_results=[m.UtilityResult(3, "pong")], engine_dead=None), m.EngineCoreOutputs),
    (m.SchedulerOutput(
        scheduled_new_reqs=[m.NewRequestData("r2", [1] * 300, [4, 5], PARAMS, [0, 1, 2], 16)],
        scheduled_cached_reqs=m.CachedRequestData(["r1"], [[7]], [33]),
        num_scheduled_tokens={"r1": 1, "r2": 290}, total_num_scheduled_tokens=291, finished_req_ids=["r0"]),
        m.SchedulerOutput),
    (m.ModelRunnerOutput(["r1", "r2"], [5, -1], [m.LogprobsEntry([5], [-0.5], 2), None]), m.ModelRunnerOutput),
    (m.WorkerResponse(0, "output", output=m.ModelRunnerOutput(["a"], [1])), m.WorkerResponse),
    (m.ExecuteModel(m.SchedulerOutput([], m.CachedRequestData(), {}, 0, [])), m.WorkerInput),
    (m.EngineReady(m.EngineInfo(served_model_name="m", model_path="/m.gguf", tokenizer="/tok", max_model_len=512,
                                vocab_size=49152, eos_token_ids=[2], max_waiting_requests=None, block_size=16,
                                num_blocks=10)), m.EngineHandshake),
]


@pytest.mark.parametrize("msg,typ", MESSAGES, ids=[type(x[0]).__name__ for x in MESSAGES])
def test_message_roundtrip(msg, typ):
    assert roundtrip(msg, typ) == msg


class Carrier(msgspec.Struct):
    items: Any


@pytest.mark.parametrize("msg,typ", MESSAGES[:3], ids=[type(x[0]).__name__ for x in MESSAGES[:3]])
def test_a_message_is_one_frame(msg, typ):
    frames = MsgpackEncoder().encode(msg)
    assert len(frames) == 1
    assert MsgpackDecoder(typ).decode(frames[0]) == msg      # the bare body decodes too


# Tensors and arrays are refused, not carried: no message has one, and ipc/ must not need torch.
@pytest.mark.parametrize("bad", [lambda: 1, object(), {object()}, torch.zeros(2), np.zeros(2), np.int64(3)],
                         ids=["lambda", "object", "set", "tensor", "array", "numpy-scalar"])
def test_unknown_objects_refused(bad):
    with pytest.raises(TypeError, match="cannot serialize"):
        MsgpackEncoder().encode(Carrier(bad))


def _ext(code: int, data: bytes = b"") -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, data)


@pytest.mark.parametrize("code", [0, 1, 2, 9, 127])
def test_ext_frames_rejected(code):
    """Ext types 1 and 2 were tensors and arrays once; a hostile peer may still send any Ext."""
    payload = msgspec.msgpack.encode(["float32", [1 << 39, 1 << 39], 1])
    with pytest.raises(ValueError, match=f"extension type {code} is not accepted"):
        MsgpackDecoder(Carrier).decode([msgspec.msgpack.encode(Carrier(_ext(code, payload)))])
    nested = m.EngineCoreOutputs(utility_results=[m.UtilityResult(1, [1, _ext(code)])])
    with pytest.raises(ValueError, match="extension type"):
        MsgpackDecoder(m.EngineCoreOutputs).decode(MsgpackEncoder().encode(nested))
    with pytest.raises((ValueError, msgspec.DecodeError)):
        MsgpackDecoder(m.EngineCoreInput).decode([msgspec.msgpack.encode(_ext(code, payload))])


@pytest.mark.parametrize("frames", [[], [b"\x90", b"extra"], [b"\x91\xa5abort"] * 3, "ab", [None], [1.5], 7])
def test_not_one_frame_refused(frames):
    with pytest.raises(ValueError, match="frame"):
        MsgpackDecoder(m.EngineCoreInput).decode(frames)


@pytest.mark.parametrize("frames", [[b"\xc1"], [b""], [b"\x92\x01"],
                                    [msgspec.msgpack.encode(_ext(1, b"\x93\xa7float32\x91\x04\x05"))],
                                    [msgspec.msgpack.encode(_ext(9))]])
def test_garbage_frames_raise_cleanly(frames):
    with pytest.raises((ValueError, msgspec.DecodeError)):
        MsgpackDecoder(m.EngineCoreInput).decode(frames)
    with pytest.raises((ValueError, msgspec.DecodeError)):
        MsgpackDecoder(Carrier).decode(frames)


def test_ipc_imports_neither_torch_nor_numpy():
    """The API process imports ipc/; torch (and numpy) stay out of it."""
    code = ("import sys, pagedserve.ipc.serial, pagedserve.ipc.messages, pagedserve.ipc.sockets, "
            "pagedserve.ipc.broadcast; print(sorted({'torch', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_pickle_in_ipc():
    ipc_dir = pathlib.Path(__file__).resolve().parents[2] / "ipc"
    for path in ipc_dir.glob("*.py"):
        text = path.read_text()
        for word in ("import pickle", "cloudpickle", "from pickle", "marshal"):
            assert word not in text, f"{path.name} mentions {word}"


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_socket_pair_exchanges_messages(transport):
    ctx = zmq.Context()
    with IpcPaths("t") as paths:
        addr = paths.new("x") if transport == "ipc" else f"tcp://127.0.0.1:{free_tcp_port()}"
        pull = make_socket(ctx, addr, zmq.PULL, bind=True)
        push = make_socket(ctx, addr, zmq.PUSH, bind=False)
        msg = MESSAGES[4][0]
        push.send_multipart(MsgpackEncoder().encode(msg))
        assert pull.poll(5000)
        assert MsgpackDecoder(m.SchedulerOutput).decode(pull.recv_multipart()) == msg
        push.close()
        pull.close()
        root = paths.root
    assert not pathlib.Path(root).exists()
    ctx.term()
    a, b = IpcPaths("t"), IpcPaths("t")
    assert a.new("in") != b.new("in")
    a.close()
    b.close()


def _reader(handle: bytes, rank: int, count: int, out) -> None:
    reader = BroadcastReader.connect(handle, rank)
    got = [MsgpackDecoder(m.AbortRequests).decode(reader.recv(60.0)).request_ids[0] for _ in range(count)]
    out.put((rank, got))
    reader.close()


def test_broadcast_to_two_processes_in_order():
    writer = BroadcastWriter(num_readers=2, max_message_bytes=1 << 16)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    handle = msgspec.msgpack.encode(writer.handle())
    procs = [ctx.Process(target=_reader, args=(handle, r, 100, out)) for r in range(2)]
    for p in procs:
        p.start()
    enc = MsgpackEncoder()
    for i in range(100):
        writer.broadcast(enc.encode(m.AbortRequests([str(i)])), timeout_s=60)  # readers start slowly on a loaded machine
    results = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    assert results == {0: [str(i) for i in range(100)], 1: [str(i) for i in range(100)]}
    with pytest.raises(ValueError, match="exceeds"):
        writer.broadcast([b"x" * (1 << 17)], timeout_s=1)
    writer.close()


def test_broadcast_to_a_stuck_reader_raises():
    writer = BroadcastWriter(num_readers=1, max_message_bytes=1 << 20, queue_depth=2)
    reader = BroadcastReader.connect(writer.handle(), 0)   # connected, never reads
    time.sleep(0.2)
    start = time.monotonic()
    with pytest.raises(BroadcastOverflowError, match="reader 0"):
        for _ in range(10_000):
            writer.broadcast([b"y" * 60_000], timeout_s=0.5)
    assert time.monotonic() - start < 30
    reader.close()
    writer.close()


def test_tcp_sockets_admit_only_the_key_holder():
    """On TCP (workers on other nodes) every bound socket is a CURVE server: a peer without the handed-out key
    neither takes a broadcast step (a PUSH would round-robin to it) nor gets a forged reply in."""
    from pagedserve.ipc.bound_sockets import BoundSockets
    from pagedserve.ipc.curve import CurveClientKeys
    writer = BroadcastWriter(num_readers=1, max_message_bytes=1 << 16, tcp_host="127.0.0.1")
    handle = writer.handle()
    assert handle.paths[0].startswith("tcp://127.0.0.1:") and handle.curve is not None
    ctx = zmq.Context()
    intruder = make_socket(ctx, handle.paths[0], zmq.PULL, bind=False)        # no keys at all
    _, stolen_public = zmq.curve_keypair()
    other_public, other_secret = zmq.curve_keypair()                         # the server's key, its own pair
    impostor = make_socket(ctx, handle.paths[0], zmq.PULL, bind=False, secure=CurveClientKeys(
        handle.curve.server_public, other_public.decode(), other_secret.decode()).secure)
    reader = BroadcastReader.connect(msgspec.msgpack.encode(handle), 0)
    time.sleep(0.5)
    for i in range(20):
        writer.broadcast([str(i).encode()], timeout_s=5)
    got = [bytes(reader.recv(timeout_s=5)[0]) for _ in range(20)]
    assert got == [str(i).encode() for i in range(20)]                      # every step, none to the others
    assert not intruder.poll(300) and not impostor.poll(100)
    bound = BoundSockets("t", tcp_host="127.0.0.1")
    replies = bound.bind("resp", zmq.PULL)
    forger = make_socket(ctx, BoundSockets.address(replies), zmq.PUSH, bind=False)
    time.sleep(0.3)                       # long enough for a plain TCP peer to be connected
    try:
        forger.send(b"forged", flags=zmq.NOBLOCK)
    except zmq.Again:                     # never admitted: it has no peer to send to
        pass
    worker = make_socket(ctx, BoundSockets.address(replies), zmq.PUSH, bind=False, secure=bound.client_keys.secure)
    worker.send(b"real")
    assert replies.poll(5000) and replies.recv() == b"real"
    assert not replies.poll(300)
    for sock in (intruder, impostor, forger, worker):
        sock.close(linger=0)
    replies.close(linger=0)
    reader.close()
    bound.close()
    writer.close()
    ctx.term()
