"""Fixtures of the security tests (a pytest plugin that tests/conftest.py loads): one
token-protected sidecar for the whole session, shared by the tests that do not break it.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from security_helpers import (
    Sidecar,
    raw_session,
    running_sidecar,
)

import colocar
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.tokens import new_token


@pytest.fixture(scope="session")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """One token-protected sidecar for the tests that do not break it (session-wide: the
    security tests of several files share it)."""
    with running_sidecar(tmp_path_factory.mktemp("sidecar"), token=new_token()) as s:
        yield s


@pytest.fixture(scope="session")
def channel(sidecar: Sidecar) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(sidecar.address)
    yield ch
    ch.close()


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel) -> pb_grpc.SidecarStub:
    return pb_grpc.SidecarStub(channel)


@pytest.fixture
def session(sidecar: Sidecar, stub: pb_grpc.SidecarStub) -> Iterator[str]:
    """A session opened with the right token over raw gRPC; its blocks are freed at the end."""
    yield from raw_session(sidecar, stub)


@pytest.fixture(scope="module")
def client(sidecar: Sidecar) -> Iterator[colocar.Cluster]:
    """A colocar connection to `sidecar` for the tests of one module (opening one starts no process)."""
    c = colocar.connect([sidecar.address], token=sidecar.token, heartbeat_seconds=0.5)
    yield c
    c.close()


@pytest.fixture
def other_session(sidecar: Sidecar, stub: pb_grpc.SidecarStub) -> Iterator[str]:
    """A second raw session, as `session`."""
    yield from raw_session(sidecar, stub)
