"""ipc/: message round trips, tensors as raw frames, no pickle, sockets, broadcast."""
from __future__ import annotations

import multiprocessing
import pathlib
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from pagedserve.common.sampling_params import SamplingParams
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
    (m.EngineReady(10, 512, 49152, 16), m.EngineHandshake),
]


@pytest.mark.parametrize("msg,typ", MESSAGES, ids=[type(x[0]).__name__ for x in MESSAGES])
def test_message_roundtrip(msg, typ):
    assert roundtrip(msg, typ) == msg


class Carrier(msgspec.Struct):
    items: Any


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_tensor_frames(dtype):
    big = (torch.randn(64, 33) * 10).to(dtype)
    obj = Carrier({"big": big, "small": torch.arange(3).to(dtype), "empty": torch.empty(0, 4, dtype=dtype),
                   "scalar": torch.tensor(1, dtype=dtype), "np": np.arange(100, dtype=np.float64).reshape(10, 10)})
    frames = MsgpackEncoder().encode(obj)
    assert len(frames) == 3     # the body, the big tensor, the numpy array: small ones ride inline
    back = MsgpackDecoder(Carrier).decode(frames).items
    for key in ("big", "small", "empty", "scalar"):
        assert back[key].dtype == dtype and torch.equal(back[key], obj.items[key])
    assert np.array_equal(back["np"], obj.items["np"])
    # No copy on receive: the tensor's memory is the frame's.
    assert back["big"].untyped_storage().data_ptr() == np.frombuffer(frames[1], np.uint8).ctypes.data


@pytest.mark.parametrize("bad", [lambda: 1, object(), {object()}, np.array([object()])])
def test_unknown_objects_refused(bad):
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(Carrier(bad))


@pytest.mark.parametrize("frames", [[b"\xc1"], [b""], [b"\x92\x01"],
                                    [msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x93\xa7float32\x91\x04\x05"))],
                                    [msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b""))]])
def test_garbage_frames_raise_cleanly(frames):
    with pytest.raises((ValueError, msgspec.DecodeError, msgspec.ValidationError)):
        MsgpackDecoder(m.EngineCoreInput).decode(frames)
    with pytest.raises((ValueError, msgspec.DecodeError, msgspec.ValidationError)):
        MsgpackDecoder(Carrier).decode(frames)


def test_no_pickle_in_ipc():
    ipc_dir = pathlib.Path(__file__).resolve().parent.parent / "ipc"
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
