"""What the security tests share: real sidecar processes started with the flags under test,
and raw gRPC requests built by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pathlib
import pickle
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

import colocar
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol import versions
from colocar.protocol.tokens import write_token_file

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

    @property
    def token_file(self) -> pathlib.Path:
        """The file the sidecar reads its token from (when started with one)."""
        return self.log.with_suffix(".token")

    def alive(self) -> bool:
        return self.process.poll() is None


def sidecar_argv(*flags: str, shm_dir: str = SHM_DIR) -> list[str]:
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


def kill_sidecar(process: subprocess.Popen, arena: str | None) -> None:
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
    argv = sidecar_argv("--address", address, "--ready-file", str(ready), *flags, shm_dir=shm_dir)
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
        kill_sidecar(process, info.get("arena"))


# --- raw gRPC helpers --------------------------------------------------------------------------
def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else ((TOKEN_KEY, token),)


def connect_request(session_id: str, **overrides: str) -> pb.ConnectRequest:
    local = versions.local_versions()
    fields = {
        "python_version": local["python"],
        "cloudpickle_version": local["cloudpickle"],
        "jax_version": local["jax"],
        **overrides,
    }
    return pb.ConnectRequest(session_id=session_id, controller="test_security", **fields)


def rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def code_fields(code_bytes: bytes) -> dict[str, Any]:
    return {"code": code_bytes, "code_hash": hashlib.sha256(code_bytes).digest()}


BENIGN_CODE = pickle.dumps(repr)  # builtins.repr, by reference: runs nothing when loaded
NO_ARGS = pickle.dumps(((), {}))
ONE_ARG = pickle.dumps(((7,), {}))  # repr(7) == "7"


class Touch:
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


def args_with_ref(index: int, shape: tuple[int, ...], dtype: str = "float64") -> bytes:
    """An (args, kwargs) pickle holding one array reference, as the controller writes them."""
    buffer = io.BytesIO()
    _RefPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(((_ArrayRef(index, shape, dtype),), {}))
    return buffer.getvalue()


def pool_usage(stub: pb_grpc.SidecarStub, token: str | None) -> tuple[int, int]:
    """(bytes used, live blocks) of the default pool."""
    reply = stub.Stats(pb.Empty(), metadata=token_metadata(token), timeout=RPC_TIMEOUT)
    (default,) = [p for p in reply.pools if p.name == "default"]
    return default.used, default.blocks


def raw_session(sidecar: Sidecar, stub: pb_grpc.SidecarStub) -> Iterator[str]:
    """Opens a session over raw gRPC with the right token; disconnects it (freeing its blocks) after."""
    session_id = uuid.uuid4().hex
    stub.Connect(connect_request(session_id), metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT)
    yield session_id
    stub.Disconnect(
        pb.SessionRef(session_id=session_id), metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT
    )


def assert_serving(sidecar: Sidecar, client: colocar.Cluster) -> None:
    """The sidecar process is alive and a normal colocated call still works."""
    log = sidecar.log.read_text(errors="replace")
    assert sidecar.alive(), f"sidecar died:\n{log}"
    assert "Traceback" not in log, log  # e.g. a background release that failed in the sidecar

    @colocar.colocated
    def add(a, b):
        import os

        return a + b, os.getpid()

    assert add.on(client.hosts[0])(40, 2) == (42, sidecar.process.pid)


def release_threads() -> int:
    """How many of the controller's background release threads run now."""
    return sum(t.name.startswith("colocar-release-") for t in threading.enumerate())


def allocate(stub: pb_grpc.SidecarStub, token: str | None, session_id: str, nbytes: int) -> pb.BlockDesc:
    """One block of `nbytes` leased to the session over raw gRPC."""
    reply = stub.Allocate(
        pb.AllocateRequest(session_id=session_id, sizes=[nbytes]),
        metadata=token_metadata(token),
        timeout=RPC_TIMEOUT,
    )
    return reply.blocks[0]


def run_sidecar(argv: list[str]) -> subprocess.CompletedProcess:
    """Runs a sidecar command line expected to refuse to start; its output, as text."""
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=DEADLINE)
