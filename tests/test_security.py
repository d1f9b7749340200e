"""The sidecar runs shipped code, so its endpoint is guarded: these tests attack real sidecars.

Tokens and mutual TLS are checked before anything is unpickled; malformed and hostile input is
refused with a status code and never takes the server down; unsafe configurations refuse to
start; arenas of dead sidecars are swept. Every sidecar here is a real process on loopback,
started with the flags under test, and is killed (its arena removed) even when a test fails.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import ipaddress
import json
import os
import pathlib
import pickle
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from helpers import wait_for

import colocar
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol import link, versions
from colocar.protocol.tokens import new_token, write_token_file

SHM_DIR = os.environ["COLOCAR_SHM_DIR"]
TOKEN_KEY = "x-colocar-token"
DEADLINE = 60.0  # generous: sidecars start in about a second, but CI machines can be slow
RPC_TIMEOUT = 30.0
ARENA = "16M"


# --- sidecar processes -------------------------------------------------------------------------
@dataclass
class Sidecar:
    process: subprocess.Popen
    address: str
    arena: str
    token: str | None
    log: pathlib.Path

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.process.poll() is None


def _argv(*flags: str, shm_dir: str = SHM_DIR) -> list[str]:
    return [
        sys.executable,
        "-m",
        "colocar.sidecar",
        "--shm-dir",
        shm_dir,
        "--arena-size",
        ARENA,
        "--processes",
        "0",
        "--lease-seconds",
        "30",
        "--parent-pid",
        str(os.getpid()),  # no orphan if pytest itself is killed
        *flags,
    ]


def _kill(process: subprocess.Popen, arena: str | None) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=DEADLINE)
    if arena:  # a killed sidecar leaves its arena and its local-link socket
        for path in (arena, arena.removesuffix(".arena") + ".sock"):
            if os.path.exists(path):
                os.unlink(path)


@contextlib.contextmanager
def running_sidecar(
    workdir: pathlib.Path,
    *flags: str,
    token: str | None = None,
    address: str = "127.0.0.1:0",
    shm_dir: str = SHM_DIR,
) -> Iterator[Sidecar]:
    """Starts `python -m colocar.sidecar` with `flags`, waits for its ready file, kills it after."""
    name = uuid.uuid4().hex[:8]
    ready = workdir / f"{name}.ready"
    log = workdir / f"{name}.log"
    argv = _argv("--address", address, "--ready-file", str(ready), *flags, shm_dir=shm_dir)
    if token is not None:
        token_file = workdir / f"{name}.token"
        write_token_file(str(token_file), token)
        argv += ["--token-file", str(token_file)]
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    info: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + DEADLINE
        while not ready.exists():
            if process.poll() is not None:
                pytest.fail(f"sidecar exited with {process.returncode}:\n{log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"sidecar not ready within {DEADLINE} s:\n{log.read_text()}")
            time.sleep(0.02)
        info = json.loads(ready.read_text())
        yield Sidecar(process, info["address"], info["arena"], token, log)
    finally:
        _kill(process, info.get("arena"))


# --- raw gRPC helpers --------------------------------------------------------------------------
def _md(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else ((TOKEN_KEY, token),)


def _connect_request(session_id: str, **overrides: str) -> pb.ConnectRequest:
    local = versions.local_versions()
    fields = {
        "python_version": local["python"],
        "cloudpickle_version": local["cloudpickle"],
        "jax_version": local["jax"],
        **overrides,
    }
    return pb.ConnectRequest(session_id=session_id, controller="test_security", **fields)


def _rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def _code(code_bytes: bytes) -> dict[str, Any]:
    return {"code": code_bytes, "code_hash": hashlib.sha256(code_bytes).digest()}


BENIGN_CODE = pickle.dumps(repr)  # builtins.repr, by reference: runs nothing when loaded
NO_ARGS = pickle.dumps(((), {}))
ONE_ARG = pickle.dumps(((7,), {}))  # repr(7) == "7"


class _Touch:
    """Unpickling this creates a file: stands for any code a hostile pickle would run."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


class _ArrayRef:
    def __init__(self, index: int, shape: tuple[int, ...], dtype: str):
        self.pid = ("colocar.array", index, shape, dtype)


class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _ArrayRef) else None


def _args_with_ref(index: int, shape: tuple[int, ...], dtype: str = "float64") -> bytes:
    """An (args, kwargs) pickle holding one array reference, as the controller writes them."""
    buffer = io.BytesIO()
    _RefPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(((_ArrayRef(index, shape, dtype),), {}))
    return buffer.getvalue()


def _pool_usage(stub: pb_grpc.SidecarStub, token: str | None) -> tuple[int, int]:
    """(bytes used, live blocks) of the default pool."""
    reply = stub.Stats(pb.Empty(), metadata=_md(token), timeout=RPC_TIMEOUT)
    (default,) = [p for p in reply.pools if p.name == "default"]
    return default.used, default.blocks


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """One token-protected sidecar for the tests that do not break it."""
    with running_sidecar(tmp_path_factory.mktemp("sidecar"), token=new_token()) as s:
        yield s


@pytest.fixture(scope="module")
def channel(sidecar: Sidecar) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(sidecar.address)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.SidecarStub:
    return pb_grpc.SidecarStub(channel)


@pytest.fixture
def session(sidecar: Sidecar, stub: pb_grpc.SidecarStub) -> Iterator[str]:
    """A session opened with the right token over raw gRPC; its blocks are freed at the end."""
    yield from _raw_session(sidecar, stub)


def _raw_session(sidecar: Sidecar, stub: pb_grpc.SidecarStub) -> Iterator[str]:
    session_id = uuid.uuid4().hex
    stub.Connect(_connect_request(session_id), metadata=_md(sidecar.token), timeout=RPC_TIMEOUT)
    yield session_id
    stub.Disconnect(pb.SessionRef(session_id=session_id), metadata=_md(sidecar.token), timeout=RPC_TIMEOUT)


@pytest.fixture(scope="module")
def client(sidecar: Sidecar) -> Iterator[colocar.Cluster]:
    c = colocar.connect([sidecar.address], token=sidecar.token, heartbeat_seconds=0.5)
    yield c
    c.close()


def _assert_serving(sidecar: Sidecar, client: colocar.Cluster) -> None:
    """The sidecar process is alive and a normal colocated call still works."""
    log = sidecar.log.read_text(errors="replace")
    assert sidecar.alive(), f"sidecar died:\n{log}"
    assert "Traceback" not in log, log  # e.g. a background release that failed in the sidecar

    @colocar.colocated
    def add(a, b):
        import os

        return a + b, os.getpid()

    assert add.on(client.hosts[0])(40, 2) == (42, sidecar.process.pid)


# --- 1. tokens ---------------------------------------------------------------------------------
def _release_threads() -> int:
    return sum(t.name.startswith("colocar-release-") for t in threading.enumerate())


@pytest.mark.parametrize("token", ["wrong", None], ids=["wrong-token", "no-token"])
def test_connect_refuses_a_wrong_or_missing_token(sidecar, monkeypatch, token):
    monkeypatch.delenv("COLOCAR_TOKEN", raising=False)
    monkeypatch.delenv("COLOCAR_TOKEN_FILE", raising=False)
    threads = _release_threads()
    with pytest.raises(colocar.AuthError, match="refused the token"):
        colocar.connect([sidecar.address], token=token, connect_timeout=RPC_TIMEOUT)
    # A refused connection leaves no background thread (nor channel) behind.
    wait_for(lambda: _release_threads() == threads, "the failed connection's threads to end", timeout=15)


def _every_rpc(stub: pb_grpc.SidecarStub, session_id: str) -> dict[str, Callable[[Any], Any]]:
    """One call of each Sidecar RPC, given the metadata; streams are drained."""
    sid = session_id
    t = RPC_TIMEOUT
    call = pb.CallRequest(session_id=sid, name="f", args=pb.Payload(pickle=ONE_ARG), **_code(BENIGN_CODE))
    return {
        "Connect": lambda md: stub.Connect(_connect_request(sid), metadata=md, timeout=t),
        "Keepalive": lambda md: stub.Keepalive(pb.SessionRef(session_id=sid), metadata=md, timeout=t),
        "Disconnect": lambda md: stub.Disconnect(pb.SessionRef(session_id=sid), metadata=md, timeout=t),
        "Call": lambda md: stub.Call(call, metadata=md, timeout=t),
        "Stream": lambda md: list(
            stub.Stream(iter([pb.StreamRequest(call=call, credits=1)]), metadata=md, timeout=t)
        ),
        "DeleteObject": lambda md: stub.DeleteObject(
            pb.ObjectRef(session_id=sid, object_id=1), metadata=md, timeout=t
        ),
        "FindObject": lambda md: stub.FindObject(pb.ObjectRef(object_name="x"), metadata=md, timeout=t),
        "Allocate": lambda md: stub.Allocate(
            pb.AllocateRequest(session_id=sid, sizes=[4096]), metadata=md, timeout=t
        ),
        "Release": lambda md: stub.Release(
            pb.ReleaseRequest(session_id=sid, block_ids=[1]), metadata=md, timeout=t
        ),
        "Upload": lambda md: stub.Upload(
            iter([pb.Chunk(session_id=sid, total_bytes=4, data=b"abcd")]), metadata=md, timeout=t
        ),
        "Download": lambda md: list(
            stub.Download(pb.BlockRef(session_id=sid, block_id=1), metadata=md, timeout=t)
        ),
        "Logs": lambda md: next(stub.Logs(pb.SessionRef(session_id=sid), metadata=md, timeout=t)),
        "PollLogs": lambda md: stub.PollLogs(pb.LogPoll(session_id=sid), metadata=md, timeout=t),
        "Cancel": lambda md: stub.Cancel(
            pb.CancelRequest(session_id=sid, call_ids=[1]), metadata=md, timeout=t
        ),
        "Stats": lambda md: stub.Stats(pb.Empty(), metadata=md, timeout=t),
    }


def test_every_rpc_is_refused_without_the_right_token(sidecar, stub, session):
    rpcs = _every_rpc(stub, session)
    assert set(rpcs) == set(pb.DESCRIPTOR.services_by_name["Sidecar"].methods_by_name)
    before = stub.Stats(pb.Empty(), metadata=_md(sidecar.token), timeout=RPC_TIMEOUT)
    wrong = [None, "", "wrong", sidecar.token[:-1], sidecar.token + "0", sidecar.token.upper()]
    for token in wrong:
        for name, rpc in rpcs.items():
            e = _rpc_error(lambda rpc=rpc, token=token: rpc(_md(token)))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (name, token, e.code(), e.details())
    # A duplicated metadata entry: the first one is checked.
    e = _rpc_error(lambda: rpcs["Stats"](((TOKEN_KEY, "wrong"), (TOKEN_KEY, sidecar.token))))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    # Nothing changed on the sidecar: no call ran, no block, no session was opened or closed.
    after = stub.Stats(pb.Empty(), metadata=_md(sidecar.token), timeout=RPC_TIMEOUT)
    assert (after.calls, after.sessions) == (before.calls, before.sessions)
    assert list(after.pools) == list(before.pools)
    ref = pb.SessionRef(session_id=session)
    assert stub.Keepalive(ref, metadata=_md(sidecar.token), timeout=RPC_TIMEOUT).known
    # The control: with the right token the same raw calls are accepted.
    assert pickle.loads(rpcs["Call"](_md(sidecar.token)).result.pickle) == "7"
    assert rpcs["Allocate"](_md(sidecar.token)).blocks[0].nbytes == 4096


def test_health_service_needs_no_token(sidecar):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(sidecar.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# --- 2. hostile pickles ------------------------------------------------------------------------
def test_hostile_pickle_never_runs_without_the_right_token(sidecar, stub, session, tmp_path):
    code_sentinel = tmp_path / "code-ran"
    args_sentinel = tmp_path / "args-ran"
    hostile_code = pickle.dumps(_Touch(code_sentinel))
    hostile_args = pickle.dumps(((_Touch(args_sentinel),), {}))
    request = pb.CallRequest(
        session_id=session, name="evil", args=pb.Payload(pickle=hostile_args), **_code(hostile_code)
    )
    stream = lambda md: list(
        stub.Stream(iter([pb.StreamRequest(call=request, credits=1)]), metadata=md, timeout=RPC_TIMEOUT)
    )
    for token in (None, "", "wrong", sidecar.token[:-1]):
        for send in (lambda md: stub.Call(request, metadata=md, timeout=RPC_TIMEOUT), stream):
            e = _rpc_error(lambda send=send, token=token: send(_md(token)))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not code_sentinel.exists() and not args_sentinel.exists()

    # The right token but a session that does not exist: refused before unpickling, too.
    foreign = pb.CallRequest()
    foreign.CopyFrom(request)
    foreign.session_id = "no-such-session"
    e = _rpc_error(lambda: stub.Call(foreign, metadata=_md(sidecar.token), timeout=RPC_TIMEOUT))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "unknown session" in e.details()
    # Code that does not match its hash is not loaded either.
    mismatched = pb.CallRequest()
    mismatched.CopyFrom(request)
    mismatched.code_hash = hashlib.sha256(b"something else").digest()
    reply = stub.Call(mismatched, metadata=_md(sidecar.token), timeout=RPC_TIMEOUT)
    assert "does not match its hash" in reply.error.message
    assert not code_sentinel.exists() and not args_sentinel.exists()

    # Control: the sentinel mechanism works, so the checks above could have failed.
    code_only = pb.CallRequest(
        session_id=session, name="evil", args=pb.Payload(pickle=NO_ARGS), **_code(hostile_code)
    )
    stub.Call(code_only, metadata=_md(sidecar.token), timeout=RPC_TIMEOUT)
    assert code_sentinel.exists() and not args_sentinel.exists()
    args_only = pb.CallRequest(
        session_id=session, name="repr", args=pb.Payload(pickle=hostile_args), **_code(BENIGN_CODE)
    )
    reply = stub.Call(args_only, metadata=_md(sidecar.token), timeout=RPC_TIMEOUT)
    assert not reply.HasField("error") and pickle.loads(reply.result.pickle) == "None"
    assert args_sentinel.exists()


# --- 3. garbage and malformed messages ---------------------------------------------------------
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
RAW_PAYLOADS = {
    "random-bytes": random.Random(1234).randbytes(64 * 1024),
    "http1-request": b"GET / HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n",
    "http1-post": b"POST /colocar.v1.Sidecar/Call HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
    "truncated-preface": PREFACE[:10],
    "preface-then-garbage": PREFACE + random.Random(99).randbytes(4096),
    # a SETTINGS frame header announcing a 16 MiB payload that never comes
    "preface-then-huge-frame": PREFACE + b"\xff\xff\xff\x04\x00\x00\x00\x00\x00" + b"\x00" * 64,
    "nothing": b"",
}


@pytest.mark.parametrize("payload", list(RAW_PAYLOADS.values()), ids=list(RAW_PAYLOADS))
def test_garbage_on_the_port_does_not_hurt(sidecar, client, payload):
    sockets = []
    try:
        for _ in range(8):  # several at once, left open while the server is checked
            s = socket.create_connection(("127.0.0.1", sidecar.port), timeout=RPC_TIMEOUT)
            sockets.append(s)
            s.sendall(payload)
        _assert_serving(sidecar, client)
        for s in sockets:
            with contextlib.suppress(OSError):  # the server may have closed it already
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                while s.recv(65536):
                    pass
    finally:
        for s in sockets:
            s.close()
    _assert_serving(sidecar, client)


@pytest.mark.parametrize(
    "method", ["Connect", "Call", "Allocate", "Disconnect", "Keepalive", "FindObject", "Download"]
)
@pytest.mark.parametrize(
    "data",
    [b"\xff\xff\xff\xff\xff", b"\x0a\xff\xff\xff\x0f", b"\x0a\x02\xc3\x28", b"\x08" + b"\xff" * 11],
    ids=["bad-tag", "truncated-length", "invalid-utf8", "overlong-varint"],
)
def test_invalid_protobuf_bytes_are_refused(sidecar, client, channel, method, data):
    rpc = channel.unary_stream if method == "Download" else channel.unary_unary
    call = rpc(f"/colocar.v1.Sidecar/{method}")  # no (de)serializers: raw bytes go out as they are
    md = _md(sidecar.token)

    def send() -> Any:
        reply = call(data, metadata=md, timeout=RPC_TIMEOUT)
        return list(reply) if method == "Download" else reply

    e = _rpc_error(send)
    assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), e
    _assert_serving(sidecar, client)


def test_invalid_protobuf_in_client_streams_is_refused(sidecar, client, channel):
    md = _md(sidecar.token)
    upload = channel.stream_unary("/colocar.v1.Sidecar/Upload")
    stream = channel.stream_stream("/colocar.v1.Sidecar/Stream")
    for data in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\x0f"):
        e = _rpc_error(lambda data=data: upload(iter([data]), metadata=md, timeout=RPC_TIMEOUT))
        assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), e
        e = _rpc_error(lambda data=data: list(stream(iter([data]), metadata=md, timeout=RPC_TIMEOUT)))
        assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), e
    _assert_serving(sidecar, client)


@pytest.fixture
def other_session(sidecar: Sidecar, stub: pb_grpc.SidecarStub) -> Iterator[str]:
    yield from _raw_session(sidecar, stub)


def _allocate(stub: pb_grpc.SidecarStub, token: str | None, session_id: str, nbytes: int) -> pb.BlockDesc:
    reply = stub.Allocate(
        pb.AllocateRequest(session_id=session_id, sizes=[nbytes]), metadata=_md(token), timeout=RPC_TIMEOUT
    )
    return reply.blocks[0]


BAD_PAYLOADS = {
    # name -> (args pickle, block descriptors) built from the session's own 4 KiB block `b`
    "unleased-block-id": lambda b: (NO_ARGS, [pb.BlockDesc(id=b.id + 10_000, offset=b.offset, nbytes=8)]),
    "wrong-offset": lambda b: (NO_ARGS, [pb.BlockDesc(id=b.id, offset=b.offset + 64, nbytes=8)]),
    "offset-outside-arena": lambda b: (NO_ARGS, [pb.BlockDesc(id=b.id, offset=2**63, nbytes=8)]),
    "nbytes-beyond-block": lambda b: (NO_ARGS, [pb.BlockDesc(id=b.id, offset=b.offset, nbytes=b.nbytes + 1)]),
    "reference-without-block": lambda b: (_args_with_ref(0, (8,)), []),
    "reference-past-blocks": lambda b: (_args_with_ref(3, (8,)), [b]),
    "array-larger-than-block": lambda b: (_args_with_ref(0, (1 << 20,)), [b]),
    "negative-dimension": lambda b: (_args_with_ref(0, (-1,)), [b]),
    "overflowing-shape": lambda b: (_args_with_ref(0, (1 << 32, 1 << 32)), [b]),
    "object-dtype": lambda b: (_args_with_ref(0, (4,), "O"), [b]),
    "garbage-pickle": lambda b: (b"\x80\x05garbage", []),
    "truncated-pickle": lambda b: (NO_ARGS[:-3], []),
}


@pytest.mark.parametrize("make", list(BAD_PAYLOADS.values()), ids=list(BAD_PAYLOADS))
def test_malformed_payloads_are_invalid_argument(sidecar, client, stub, session, make):
    used_before = _pool_usage(stub, sidecar.token)
    block = _allocate(stub, sidecar.token, session, 4096)
    args, blocks = make(block)
    request = pb.CallRequest(
        session_id=session, name="repr", args=pb.Payload(pickle=args, blocks=blocks), **_code(BENIGN_CODE)
    )
    md = _md(sidecar.token)
    e = _rpc_error(lambda: stub.Call(request, metadata=md, timeout=RPC_TIMEOUT))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    e = _rpc_error(
        lambda: list(
            stub.Stream(iter([pb.StreamRequest(call=request, credits=1)]), metadata=md, timeout=RPC_TIMEOUT)
        )
    )
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    _assert_serving(sidecar, client)
    # Refused requests leave no lease behind: once the session lets go of its block, it is free.
    release = pb.ReleaseRequest(session_id=session, block_ids=[block.id])
    stub.Release(release, metadata=md, timeout=RPC_TIMEOUT)
    wait_for(lambda: _pool_usage(stub, sidecar.token) == used_before, "the block to be freed", timeout=10)


def test_hand_built_array_reference_is_understood(sidecar, stub, session):
    """Control for the cases above: the same hand-built reference, well formed, is accepted."""
    block = _allocate(stub, sidecar.token, session, 4096)
    request = pb.CallRequest(
        session_id=session,
        name="repr",
        args=pb.Payload(pickle=_args_with_ref(0, (2, 3), "int16"), blocks=[block]),
        **_code(BENIGN_CODE),
    )
    reply = stub.Call(request, metadata=_md(sidecar.token), timeout=RPC_TIMEOUT)
    assert not reply.HasField("error"), reply.error.traceback
    assert pickle.loads(reply.result.pickle).startswith("array([[")


def test_blocks_of_another_session_are_out_of_reach(sidecar, client, stub, session, other_session):
    md = _md(sidecar.token)
    theirs = _allocate(stub, sidecar.token, other_session, 4096)
    request = pb.CallRequest(
        session_id=session,
        name="repr",
        args=pb.Payload(pickle=_args_with_ref(0, (512,)), blocks=[theirs]),
        consume_blocks=[theirs.id],
        **_code(BENIGN_CODE),
    )
    e = _rpc_error(lambda: stub.Call(request, metadata=md, timeout=RPC_TIMEOUT))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "not leased by this session" in e.details()
    e = _rpc_error(
        lambda: list(
            stub.Download(
                pb.BlockRef(session_id=session, block_id=theirs.id), metadata=md, timeout=RPC_TIMEOUT
            )
        )
    )
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Our Release of their block id, and our consume_blocks naming it, change nothing for them.
    release = pb.ReleaseRequest(session_id=session, block_ids=[theirs.id])
    stub.Release(release, metadata=md, timeout=RPC_TIMEOUT)
    ref = pb.BlockRef(session_id=other_session, block_id=theirs.id)
    chunks = list(stub.Download(ref, metadata=md, timeout=RPC_TIMEOUT))
    assert sum(len(c.data) for c in chunks) == 4096
    _assert_serving(sidecar, client)


def test_unknown_session_is_failed_precondition(sidecar, client, stub):
    md = _md(sidecar.token)
    sid = "never-connected"
    kw = {"metadata": md, "timeout": RPC_TIMEOUT}
    call = pb.CallRequest(session_id=sid, name="repr", args=pb.Payload(pickle=NO_ARGS), **_code(BENIGN_CODE))
    attempts = {
        "Call": lambda: stub.Call(call, metadata=md, timeout=RPC_TIMEOUT),
        "Stream": lambda: list(stub.Stream(iter([pb.StreamRequest(call=call, credits=1)]), **kw)),
        "Allocate": lambda: stub.Allocate(pb.AllocateRequest(session_id=sid, sizes=[64]), **kw),
        "Upload": lambda: stub.Upload(iter([pb.Chunk(session_id=sid, total_bytes=1, data=b"x")]), **kw),
        "Download": lambda: list(stub.Download(pb.BlockRef(session_id=sid, block_id=1), **kw)),
        "Release": lambda: stub.Release(pb.ReleaseRequest(session_id=sid, block_ids=[1]), **kw),
    }
    for name, attempt in attempts.items():
        e = _rpc_error(attempt)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "unknown session" in e.details(), name
    assert not stub.Keepalive(pb.SessionRef(session_id=sid), metadata=md, timeout=RPC_TIMEOUT).known
    _assert_serving(sidecar, client)


def test_malformed_streams_and_uploads(sidecar, client, stub, session):
    md = _md(sidecar.token)
    used_before = _pool_usage(stub, sidecar.token)

    def stream(messages: list[pb.StreamRequest]) -> list[pb.CallReply]:
        return list(stub.Stream(iter(messages), metadata=md, timeout=RPC_TIMEOUT))

    def upload(chunks: list[pb.Chunk]) -> pb.BlockDesc:
        return stub.Upload(iter(chunks), metadata=md, timeout=RPC_TIMEOUT)

    invalid = {
        "stream-without-call": lambda: stream([pb.StreamRequest(credits=5)]),
        "empty-stream": lambda: stream([]),
        "empty-upload": lambda: upload([]),
        "upload-past-total": lambda: upload(
            [pb.Chunk(session_id=session, total_bytes=8, data=b"12345"), pb.Chunk(data=b"6789")]
        ),
        "upload-first-chunk-past-total": lambda: upload([pb.Chunk(session_id=session, data=b"x")]),
        "upload-short": lambda: upload([pb.Chunk(session_id=session, total_bytes=8, data=b"1234")]),
        "upload-unknown-pool": lambda: upload(
            [pb.Chunk(session_id=session, total_bytes=1, pool="nope", data=b"x")]
        ),
        "allocate-unknown-pool": lambda: stub.Allocate(
            pb.AllocateRequest(session_id=session, sizes=[64], pool="nope"), metadata=md, timeout=RPC_TIMEOUT
        ),
    }
    for name, attempt in invalid.items():
        e = _rpc_error(attempt)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.code(), e.details())
    too_big = {
        "upload": lambda: upload([pb.Chunk(session_id=session, total_bytes=1 << 40, data=b"x")]),
        "allocate": lambda: stub.Allocate(
            pb.AllocateRequest(session_id=session, sizes=[64, 1 << 62]), metadata=md, timeout=RPC_TIMEOUT
        ),
    }
    for name, attempt in too_big.items():
        e = _rpc_error(attempt)
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (name, e.code(), e.details())
    e = _rpc_error(
        lambda: stub.Call(
            pb.CallRequest(session_id=session, kind=pb.CallRequest.METHOD, object_id=12345, method="m"),
            metadata=md,
            timeout=RPC_TIMEOUT,
        )
    )
    assert e.code() == grpc.StatusCode.NOT_FOUND
    e = _rpc_error(
        lambda: stub.Call(
            pb.CallRequest(session_id=session, name="f", code_hash=b"\x00" * 32),
            metadata=md,
            timeout=RPC_TIMEOUT,
        )
    )
    assert e.code() == grpc.StatusCode.NOT_FOUND and e.details().startswith("code:")
    # Every refused upload and allocation gave its blocks back.
    assert _pool_usage(stub, sidecar.token) == used_before
    _assert_serving(sidecar, client)


# --- 4. unsafe configurations ------------------------------------------------------------------
def _run_sidecar(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=DEADLINE)


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", ":0", "10.255.255.1:0", "localhost.example:0"])
def test_network_address_without_auth_refuses_to_start(tmp_path, address):
    shm = tmp_path / "shm"
    shm.mkdir()
    done = _run_sidecar(_argv("--address", address, shm_dir=str(shm)))
    assert done.returncode != 0
    assert "refusing to listen" in done.stderr and "--token-file" in done.stderr and "TLS" in done.stderr
    assert os.listdir(shm) == [], "no arena may be created before the safety check"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_token_file_readable_by_others_is_refused(tmp_path, mode):
    shm = tmp_path / "shm"
    shm.mkdir()
    token_file = tmp_path / "token"
    token_file.write_text(new_token())
    token_file.chmod(mode)
    done = _run_sidecar(_argv("--address", "0.0.0.0:0", "--token-file", str(token_file), shm_dir=str(shm)))
    assert done.returncode != 0
    assert f"chmod 600 {token_file}" in done.stderr
    assert os.listdir(shm) == []


def test_empty_token_file_is_refused(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    token_file = tmp_path / "token"
    write_token_file(str(token_file), "  \n")
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    done = _run_sidecar(_argv("--address", "0.0.0.0:0", "--token-file", str(token_file), shm_dir=str(shm)))
    assert done.returncode != 0 and "is empty" in done.stderr
    assert os.listdir(shm) == []


# --- 5. version skew ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value, named",
    [("python_version", "2.7", "python"), ("cloudpickle_version", "0.0.1", "cloudpickle")],
)
def test_version_skew_is_refused_at_connect(sidecar, stub, field, value, named):
    session_id = uuid.uuid4().hex
    e = _rpc_error(
        lambda: stub.Connect(
            _connect_request(session_id, **{field: value}), metadata=_md(sidecar.token), timeout=RPC_TIMEOUT
        )
    )
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{named} {value} on the controller" in e.details()
    # No session was opened for it.
    ref = pb.SessionRef(session_id=session_id)
    assert not stub.Keepalive(ref, metadata=_md(sidecar.token), timeout=RPC_TIMEOUT).known


def test_controller_raises_version_skew_error(sidecar, monkeypatch):
    real = versions.local_versions()
    monkeypatch.setattr(versions, "local_versions", lambda: {**real, "python": "2.7"})
    threads = _release_threads()
    with pytest.raises(colocar.VersionSkewError, match="python 2.7 on the controller"):
        colocar.connect([sidecar.address], token=sidecar.token, connect_timeout=RPC_TIMEOUT)
    wait_for(lambda: _release_threads() == threads, "the failed connection's threads to end", timeout=15)


# --- 6. stale arenas ---------------------------------------------------------------------------
def test_arena_of_a_killed_sidecar_is_removed_by_the_next_start(sidecar, tmp_path):
    with running_sidecar(tmp_path, token=new_token()) as doomed:
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=DEADLINE)
        stale = doomed.arena
        assert os.path.exists(stale), "a SIGKILLed sidecar cannot remove its own arena"
        with running_sidecar(tmp_path, token=new_token()) as fresh:
            assert not os.path.exists(stale), "the next sidecar sweeps the dead one's arena"
            assert not os.path.exists(stale.removesuffix(".arena") + ".sock"), "and its link socket"
            assert os.path.exists(fresh.arena)
            assert os.path.exists(sidecar.arena), "a live sidecar's arena is never swept"


# --- 7. mutual TLS -----------------------------------------------------------------------------
@dataclass
class Pki:
    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    rogue_cert: pathlib.Path  # signed by a CA the sidecar does not trust
    rogue_key: pathlib.Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    root = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(key: Any, path: pathlib.Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)

    def issue(
        subject: str,
        key: Any,
        issuer: Any,
        issuer_key: Any,
        *,
        ca: bool,
        usage: Any = None,
        sans: list[x509.GeneralName] | None = None,
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def pem(cert: x509.Certificate, path: pathlib.Path) -> pathlib.Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    files: dict[str, pathlib.Path] = {}
    cas = {}
    for ca_name in ("ca", "rogue-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = issue(f"colocar test {ca_name}", key, name(f"colocar test {ca_name}"), key, ca=True)
        cas[ca_name] = (cert, key)
        files[ca_name] = pem(cert, root / f"{ca_name}.pem")
    leaves = [
        (
            "server",
            "ca",
            ExtendedKeyUsageOID.SERVER_AUTH,
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
        ),
        ("client", "ca", ExtendedKeyUsageOID.CLIENT_AUTH, None),
        ("rogue", "rogue-ca", ExtendedKeyUsageOID.CLIENT_AUTH, None),
    ]
    for leaf, ca_name, usage, sans in leaves:
        key = ec.generate_private_key(ec.SECP256R1())
        ca_cert, ca_key = cas[ca_name]
        cert = issue(leaf, key, ca_cert.subject, ca_key, ca=False, usage=usage, sans=sans)
        files[leaf] = pem(cert, root / f"{leaf}.pem")
        files[f"{leaf}-key"] = root / f"{leaf}.key"
        write_key(key, files[f"{leaf}-key"])
    return Pki(
        files["ca"],
        files["server"],
        files["server-key"],
        files["client"],
        files["client-key"],
        files["rogue"],
        files["rogue-key"],
    )


@pytest.fixture(scope="module")
def tls_sidecar(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    tls += ["--tls-client-ca", str(pki.ca)]
    with running_sidecar(tmp_path_factory.mktemp("tls"), *tls) as s:  # no token: mTLS authenticates
        yield s


def test_mutual_tls_client_with_certificate_runs_calls(tls_sidecar, pki):
    cluster = colocar.connect(
        [tls_sidecar.address],
        tls_ca=str(pki.ca),
        tls_cert=str(pki.client_cert),
        tls_key=str(pki.client_key),
        connect_timeout=RPC_TIMEOUT,
    )
    with cluster:
        _assert_serving(tls_sidecar, cluster)


def _tls_stats(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError:
    ch = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with ch:
        return _rpc_error(lambda: pb_grpc.SidecarStub(ch).Stats(pb.Empty(), timeout=RPC_TIMEOUT))


def test_mutual_tls_refuses_clients_without_a_trusted_certificate(tls_sidecar, pki):
    ca = pki.ca.read_bytes()
    refused = {
        "no-client-cert": grpc.ssl_channel_credentials(ca),
        "untrusted-client-cert": grpc.ssl_channel_credentials(
            ca, pki.rogue_key.read_bytes(), pki.rogue_cert.read_bytes()
        ),
        "plaintext": None,
    }
    for what, credentials in refused.items():
        e = _tls_stats(tls_sidecar.address, credentials)
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (what, e.code(), e.details())
    with pytest.raises(colocar.HostLostError):
        colocar.connect([tls_sidecar.address], tls_ca=str(pki.ca), connect_timeout=3)
    assert tls_sidecar.alive()
    # Control: the trusted client certificate gets through with the same raw call.
    ch = grpc.secure_channel(
        tls_sidecar.address,
        grpc.ssl_channel_credentials(ca, pki.client_key.read_bytes(), pki.client_cert.read_bytes()),
    )
    with ch:
        assert pb_grpc.SidecarStub(ch).Stats(pb.Empty(), timeout=RPC_TIMEOUT).uptime_seconds > 0


def test_tls_without_client_certificates_is_not_enough_off_loopback(tmp_path, pki):
    shm = tmp_path / "shm"
    shm.mkdir()
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    done = _run_sidecar(_argv("--address", "0.0.0.0:0", *tls, shm_dir=str(shm)))
    assert done.returncode != 0 and "does not authenticate" in done.stderr
    done = _run_sidecar(_argv("--address", "127.0.0.1:0", "--tls-client-ca", str(pki.ca), shm_dir=str(shm)))
    assert done.returncode != 0 and "--tls-client-ca needs --tls-cert" in done.stderr
    assert os.listdir(shm) == []


# --- 8. the local link --------------------------------------------------------------------------
def test_local_link_is_private_and_checks_the_token(cluster):
    conn = cluster.hosts[0].connection
    assert conn.link is not None, "a same-host controller uses the local link"
    path = conn.info.link_path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for hello in (b"wrong", b"", conn._token.encode()[:-1]):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(DEADLINE)
            sock.connect(path)
            link.send_request(sock, link.HELLO, hello)
            status, _ = link.parse_reply(link.recv_frame(sock))
            assert status == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert sock.recv(1) == b"", "the sidecar closes a link that failed the token check"
    # A call without the hello is refused too, and nothing runs.
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(DEADLINE)
        sock.connect(path)
        link.send_request(sock, "Call", b"\x00garbage")
        status, _ = link.parse_reply(link.recv_frame(sock))
        assert status == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert colocar.colocated(lambda: 1).on(cluster.hosts[0])() == 1  # still serving


def test_local_link_rejects_garbage_frames(cluster):
    conn = cluster.hosts[1].connection
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(DEADLINE)
        sock.connect(conn.info.link_path)
        link.send_request(sock, link.HELLO, conn._token.encode())
        assert link.parse_reply(link.recv_frame(sock))[0] == 0
        for method, body in (("Call", b"\xff\xff\xff"), ("Nope", b""), ("Stream", b"")):
            link.send_request(sock, method, body)
            status, _ = link.parse_reply(link.recv_frame(sock))
            expected = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)
            assert status in [code.value[0] for code in expected]
        sock.sendall(link.LENGTH.pack(link.MAX_FRAME + 1))  # an absurd frame closes the link
        assert sock.recv(1) == b""
    assert colocar.colocated(lambda: 2).on(cluster.hosts[1])() == 2
