"""Hostile frames, sent straight to the engine core's tcp socket and into the worker channels.

Random bytes, truncated frames, wrong frame counts, msgpack of the wrong type, huge declared lengths,
pickles: the engine drops each one, logs it once (throttled, never a flood), keeps serving the same
tokens, and nothing in a frame is ever run as code.
"""
from __future__ import annotations

import os
import pathlib
import pickle
import random
import re
import stat
import time
import uuid

import httpx
import msgspec
import psutil
import pytest
import zmq

from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.backends import get_executor_class
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.ipc import messages as m
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.tests.helpers.processes.server import Server

TP2 = ("--tensor-parallel-size", "2", "--kv-cache-memory", "0.02")
GREEDY = {"prompt": [11, 12, 13, 14, 15], "max_tokens": 12, "temperature": 0, "ignore_eos": True}


class _Touch:
    """Unpickling this runs os.system: the proof that a frame was executed would be the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def hostile_bodies(canary: str) -> dict[str, list[bytes]]:
    """Message bodies (the frames after the token) by kind; every one must be dropped."""
    rng = random.Random(0)
    valid = MsgpackEncoder().encode(m.EngineCoreRequest("valid", [1, 2, 3], SamplingParams(max_tokens=4), 0.0))[0]
    pickled = pickle.dumps(_Touch(canary))
    return {
        "random bytes": [rng.randbytes(rng.randrange(1, 300)) for _ in range(100)],
        "truncated": [valid[:cut] for cut in range(1, len(valid))],
        "wrong type": [msgspec.msgpack.encode(x) for x in (
            {"request_id": "x"}, 7, "add", [], ["exec", []], ["add", "id", "not a list", {}, 0.0],
            ["utility", "not an int", "ping", []], ["abort", [1, 2]], m.EngineCoreOutputs(), m.WorkerShutdown(),
            m.EngineStartupFailed("not for the core"))],
        "huge lengths": [b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff",
                         b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\x94\xa3add" + b"\xdd\xff\xff\xff\xff",
                         # Ext 1 once carried a tensor's (dtype, shape, frame); any Ext is now refused.
                         msgspec.msgpack.encode(msgspec.msgpack.Ext(1, msgspec.msgpack.encode(
                             ["float32", [1 << 39, 1 << 39], 1])))],
        "pickle": [pickled, msgspec.msgpack.encode(["add", pickled]),
                   *(msgspec.msgpack.encode(msgspec.msgpack.Ext(code, pickled)) for code in (0, 1, 2, 3, 127))],
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # Secrets no log line could hold by chance; debug logging, so that every line that could be is written.
    srv = Server(*TP2, model=tiny_llama_dir, log_level="debug", api_key=f"sk-{uuid.uuid4().hex}",
                 token=f"tok-{uuid.uuid4().hex}")
    kids = srv.children()
    yield srv
    srv.stop_and_check_clean(kids)


def greedy_tokens(srv: Server) -> list[int]:
    resp = httpx.post(f"{srv.url}/v1/completions", json={**GREEDY, "logprobs": 0}, headers=srv.auth, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


def dealer(srv: Server, port_offset: int = 0, identity: bytes | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(f"tcp://127.0.0.1:{srv.engine_port + port_offset}")
    return sock


def engine_peer(srv: Server) -> tuple[zmq.Socket, zmq.Socket]:
    """(input, output) sockets of one client of the core, the way AsyncEngineClient connects."""
    identity = os.urandom(16)
    return dealer(srv, 0, identity), dealer(srv, 1, identity)


def test_hostile_frames_to_engine_core(server, tmp_path):
    before = greedy_tokens(server)
    canary = tmp_path / "pwned"
    token = server.token.encode()
    sock = dealer(server)
    sent = 0
    for kind, bodies in hostile_bodies(str(canary)).items():
        for body in bodies:
            sock.send_multipart([token, body])
            sock.send_multipart([b"wrong-token", body])
            sent += 2
    for frames in ([], [token], [token, b""], [b""], [token, b"\x90", b"extra", b"frames"], [b"x"] * 50):
        sock.send_multipart(frames or [b""])
        sent += 1
    # One frame over the core's size limit: ZeroMQ drops the peer before buffering it.
    big = dealer(server)
    big.send_multipart([token, b"\x00" * ((64 << 20) + 1)])
    time.sleep(1.0)
    big.close()
    sock.close()

    assert greedy_tokens(server) == before
    assert server.health() == 200
    assert not canary.exists()
    log = server.output()
    for what in ("dropped an undecodable message", "dropped a message with a wrong engine token",
                 "dropped a message of"):
        count = log.count(what)
        # Once, then at most once per 10 s: hundreds of bad frames, a handful of lines.
        assert 1 <= count <= 3, f"{what!r} logged {count} times for {sent} bad messages"


def test_schema_valid_but_hostile_requests_get_answers(server):
    """Valid msgpack, valid types, values no real client sends: each one is answered, none kills the core."""
    inp, out = engine_peer(server)
    enc, dec = MsgpackEncoder(), MsgpackDecoder(m.EngineCoreOutputs)
    token = server.token.encode()

    def send(msg) -> None:
        inp.send_multipart([token, *enc.encode(msg)])

    deadline = time.monotonic() + 30
    while not out.poll(300):        # until the core's output socket knows this peer
        assert time.monotonic() < deadline
        send(m.UtilityCall(0, "ping"))
    bad = {"empty": [], "out-of-vocab": [5, 10**9], "negative": [-1], "too-long": [3] * 5000}
    for rid, prompt in bad.items():
        send(m.EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=4), 0.0))
    # The largest values SamplingParams accepts (it refuses what msgpack cannot carry as a 64-bit int).
    extreme = SamplingParams(seed=2**64 - 1, top_k=10**9, logprobs=20, max_tokens=3, stop_token_ids=[2**63 - 1])
    send(m.EngineCoreRequest("x" * 100_000, [5, 6], extreme, 0.0, priority=-(2**63)))
    send(m.EngineCoreRequest("dup", [5, 6], SamplingParams(max_tokens=900, ignore_eos=True), 0.0))
    send(m.EngineCoreRequest("dup", [7], SamplingParams(), 0.0))
    send(m.AbortRequests(["not-mine", "x" * 1000]))
    for method in ("__class__", "shutdown", "_fail_everything", "get_engine_info"):
        send(m.UtilityCall(99, method, [1, None, "x"]))     # a real method with arguments it does not take, too
    send(m.UtilityCall(99, "get_engine_info"))
    ended: list[tuple[str, str, str | None]] = []
    utility: list[m.UtilityResult] = []
    deadline = time.monotonic() + 60
    while (len(ended) < len(bad) + 2 or len(utility) < 5) and time.monotonic() < deadline:
        if out.poll(200):
            outputs = dec.decode(out.recv_multipart())
            assert outputs.engine_dead is None
            utility += [u for u in outputs.utility_results if u.call_id == 99]
            ended += [(o.request_id[:20], o.finish_reason, o.error) for o in outputs.outputs if o.finish_reason]
    send(m.AbortRequests(["dup"]))
    while ("dup", "abort", None) not in ended and time.monotonic() < deadline:
        if out.poll(200):
            ended += [(o.request_id, o.finish_reason, o.error) for o in dec.decode(out.recv_multipart()).outputs
                      if o.finish_reason]
    inp.close()
    out.close()
    errors = {rid: error for rid, reason, error in ended if reason == "error"}
    assert set(errors) == {*bad, "dup"} and "already in use" in errors["dup"]
    assert ("x" * 20, "length", None) in ended and ("dup", "abort", None) in ended
    assert [u.error is not None for u in utility] == [True, True, True, True, False]
    assert server.health() == 200


def test_engine_token_rejected(server):
    """Without the token, with a wrong one, a prefix of it or more than it: no answer, ever."""
    token = server.token.encode()
    body = MsgpackEncoder().encode(m.UtilityCall(1, "get_engine_info"))
    bad_tokens = (None, b"", b"wrong", token[:-1], token + b"x", token.upper(), b"\x00" * len(token))
    peers = [engine_peer(server) for _ in bad_tokens]
    for _ in range(4):
        for bad, (inp, _) in zip(bad_tokens, peers):
            inp.send_multipart(body if bad is None else [bad, *body])
        time.sleep(0.5)
    for bad, (inp, out) in zip(bad_tokens, peers):
        assert not out.poll(0), f"the core answered a client with token {bad!r}"
        inp.send_multipart([token, *body])         # the same peer with the right token is answered
        assert out.poll(10_000)
        assert MsgpackDecoder(m.EngineCoreOutputs).decode(out.recv_multipart()).utility_results[0].error is None
        inp.close()
        out.close()


def test_secrets_never_in_logs_or_child_command_lines(server):
    """Runs last in this module: it drives bad auth, stops the server and reads everything it printed."""
    for proc in server.children():
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        assert server.token not in cmdline and server.api_key not in cmdline, cmdline
    url = f"{server.url}/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key},
                    {"Authorization": f"Bearer {server.api_key}x"}):
        assert httpx.post(url, json=GREEDY, headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer no"}).status_code == 401
    inp, out = engine_peer(server)
    inp.send_multipart([server.token.encode()[:-1], *MsgpackEncoder().encode(m.UtilityCall(1, "ping"))])
    inp.close()
    out.close()
    greedy_tokens(server)
    server.stop()
    log = server.output()
    assert "dropped a message with a wrong engine token" in log and "401" in log   # the output is all there
    assert server.api_key not in log
    assert server.token not in log


def test_worker_channels_drop_bad_frames(tiny_llama_dir, capfd, caplog):
    """The core -> workers broadcast, and the workers -> core response and heartbeat sockets."""
    config = EngineArgs(model=tiny_llama_dir, dtype="float32", kv_cache_memory=0.02,
                        tensor_parallel_size=2).create_engine_config()
    core = EngineCore(config, get_executor_class(config.parallel.distributed_executor_backend))
    executor = core.executor
    try:
        def run(rid: str) -> list[int]:
            core.add_request(m.EngineCoreRequest(rid, [21, 22, 23, 24], SamplingParams(temperature=0, max_tokens=10,
                                                                                       ignore_eos=True), 0.0))
            tokens: list[int] = []
            while core.has_unfinished_requests():
                tokens += [t for o in core.step().outputs for t in o.new_token_ids]
            return tokens
        before = run("a")
        # What keeps other users off these sockets: folders only their owner may enter.
        for root in (executor.bound.root, executor.writer.bound.root):
            assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        ctx = zmq.Context.instance()
        pushes = [ctx.socket(zmq.PUSH) for _ in range(2)]
        for sock, bound in zip(pushes, (executor.responses, executor.heartbeats)):
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(bound.getsockopt_string(zmq.LAST_ENDPOINT))
        legit = msgspec.msgpack.encode(m.WorkerShutdown())      # a real message on this channel
        bodies = [b for group in hostile_bodies("/nonexistent/pwned").values() for b in group if b != legit]
        for body in bodies:
            executor.writer.broadcast([body], timeout_s=10)
            for sock in pushes:
                sock.send(body)
        assert run("b") == before
        with pytest.raises(ValueError, match="not callable remotely"):
            executor.collective_rpc("load_model")     # only allowlisted methods run on a worker
        assert run("c") == before                     # a refused call is answered, not fatal
        for sock in pushes:
            sock.close()
    finally:
        core.shutdown()
    err = capfd.readouterr().err
    for rank in (0, 1):
        count = len(re.findall(rf"worker {rank} dropped an undecodable broadcast message", err))
        assert 1 <= count <= 3, (rank, count)
    here = caplog.text      # the executor runs in this process, its workers write to stderr
    assert 1 <= here.count("dropped an undecodable worker response") <= 3
    assert 1 <= here.count("dropped an undecodable heartbeat frame") <= 3


def test_no_pickle_anywhere():
    """Beyond ipc/: no module of the package may unpickle, eval or exec anything."""
    root = pathlib.Path(__file__).resolve().parents[3]
    words = ("import pickle", "from pickle", "cloudpickle", "marshal", "recv_pyobj", "send_pyobj", "eval(",
             "exec(", "torch.load(", "dill")
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in (".venv", "tests", "scripts", "build") or rel.parts[0].startswith("."):
            continue
        text = path.read_text()
        for word in words:
            # model.eval() is torch's mode switch; torch.load of local weight files only with weights_only.
            hits = [line for line in text.splitlines() if word in line and "model.eval()" not in line
                    and "weights_only=True" not in line]
            assert not hits, f"{rel} uses {word}: {hits[:2]}"
