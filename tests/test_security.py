"""The sidecar runs shipped code, so its endpoint is guarded: these tests attack real sidecars.

Tokens are checked before anything is unpickled, hostile pickles never run without them,
version skew is refused at connect, and arenas of dead sidecars are swept. Every sidecar
here is a real process on loopback, started with the flags under test, and is killed (its
arena removed) even when a test fails. Malformed input, unsafe configurations, mutual TLS
and the local link are in test_security_*.py.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from helpers import wait_for
from security_helpers import (
    BENIGN_CODE,
    DEADLINE,
    NO_ARGS,
    ONE_ARG,
    RPC_TIMEOUT,
    TOKEN_KEY,
    Touch,
    code_fields,
    connect_request,
    release_threads,
    rpc_error,
    running_sidecar,
    token_metadata,
)

import colocar
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol import versions
from colocar.protocol.tokens import new_token, write_token_file

# --- 1. tokens ---------------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["wrong", None], ids=["wrong-token", "no-token"])
def test_connect_refuses_a_wrong_or_missing_token(sidecar, monkeypatch, token):
    monkeypatch.delenv("COLOCAR_TOKEN", raising=False)
    monkeypatch.delenv("COLOCAR_TOKEN_FILE", raising=False)
    threads = release_threads()
    with pytest.raises(colocar.AuthError, match="refused the token"):
        colocar.connect([sidecar.address], token=token, connect_timeout=RPC_TIMEOUT)
    # A refused connection leaves no background thread (nor channel) behind.
    wait_for(lambda: release_threads() == threads, "the failed connection's threads to end", timeout=15)


def _every_rpc(stub: pb_grpc.SidecarStub, session_id: str) -> dict[str, Callable[[Any], Any]]:
    """One call of each Sidecar RPC, given the metadata; streams are drained."""
    sid = session_id
    t = RPC_TIMEOUT
    call = pb.CallRequest(
        session_id=sid, name="f", args=pb.Payload(pickle=ONE_ARG), **code_fields(BENIGN_CODE)
    )
    return {
        "Connect": lambda md: stub.Connect(connect_request(sid), metadata=md, timeout=t),
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
        "ListSessions": lambda md: stub.ListSessions(pb.Empty(), metadata=md, timeout=t),
        "CloseSession": lambda md: stub.CloseSession(
            pb.SessionSelector(selector=sid), metadata=md, timeout=t
        ),
    }


def test_every_rpc_is_refused_without_the_right_token(sidecar, stub, session):
    rpcs = _every_rpc(stub, session)
    assert set(rpcs) == set(pb.DESCRIPTOR.services_by_name["Sidecar"].methods_by_name)
    before = stub.Stats(pb.Empty(), metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT)
    wrong = [None, "", "wrong", sidecar.token[:-1], sidecar.token + "0", sidecar.token.upper()]
    for token in wrong:
        for name, rpc in rpcs.items():
            e = rpc_error(lambda rpc=rpc, token=token: rpc(token_metadata(token)))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (name, token, e.code(), e.details())
    # A duplicated metadata entry: the first one is checked.
    e = rpc_error(lambda: rpcs["Stats"](((TOKEN_KEY, "wrong"), (TOKEN_KEY, sidecar.token))))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    # Nothing changed on the sidecar: no call ran, no block, no session was opened or closed.
    after = stub.Stats(pb.Empty(), metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT)
    assert (after.calls, after.sessions) == (before.calls, before.sessions)
    assert list(after.pools) == list(before.pools)
    ref = pb.SessionRef(session_id=session)
    assert stub.Keepalive(ref, metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT).known
    # The control: with the right token the same raw calls are accepted.
    assert pickle.loads(rpcs["Call"](token_metadata(sidecar.token)).result.pickle) == "7"
    assert rpcs["Allocate"](token_metadata(sidecar.token)).blocks[0].nbytes == 4096


def test_health_service_needs_no_token(sidecar):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(sidecar.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# --- 2. hostile pickles ------------------------------------------------------------------------
def test_hostile_pickle_never_runs_without_the_right_token(sidecar, stub, session, tmp_path):
    code_sentinel = tmp_path / "code-ran"
    args_sentinel = tmp_path / "args-ran"
    hostile_code = pickle.dumps(Touch(code_sentinel))
    hostile_args = pickle.dumps(((Touch(args_sentinel),), {}))
    request = pb.CallRequest(
        session_id=session, name="evil", args=pb.Payload(pickle=hostile_args), **code_fields(hostile_code)
    )
    stream = lambda md: list(
        stub.Stream(iter([pb.StreamRequest(call=request, credits=1)]), metadata=md, timeout=RPC_TIMEOUT)
    )
    for token in (None, "", "wrong", sidecar.token[:-1]):
        for send in (lambda md: stub.Call(request, metadata=md, timeout=RPC_TIMEOUT), stream):
            e = rpc_error(lambda send=send, token=token: send(token_metadata(token)))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not code_sentinel.exists() and not args_sentinel.exists()

    # The right token but a session that does not exist: refused before unpickling, too.
    foreign = pb.CallRequest()
    foreign.CopyFrom(request)
    foreign.session_id = "no-such-session"
    e = rpc_error(lambda: stub.Call(foreign, metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "unknown session" in e.details()
    # Code that does not match its hash is not loaded either.
    mismatched = pb.CallRequest()
    mismatched.CopyFrom(request)
    mismatched.code_hash = hashlib.sha256(b"something else").digest()
    reply = stub.Call(mismatched, metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT)
    assert "does not match its hash" in reply.error.message
    assert not code_sentinel.exists() and not args_sentinel.exists()

    # Control: the sentinel mechanism works, so the checks above could have failed.
    code_only = pb.CallRequest(
        session_id=session, name="evil", args=pb.Payload(pickle=NO_ARGS), **code_fields(hostile_code)
    )
    stub.Call(code_only, metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT)
    assert code_sentinel.exists() and not args_sentinel.exists()
    args_only = pb.CallRequest(
        session_id=session, name="repr", args=pb.Payload(pickle=hostile_args), **code_fields(BENIGN_CODE)
    )
    reply = stub.Call(args_only, metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT)
    assert not reply.HasField("error") and pickle.loads(reply.result.pickle) == "None"
    assert args_sentinel.exists()


# --- 5. version skew ---------------------------------------------------------------------------
def test_a_rotated_token_is_refused_and_no_host_is_lost(tmp_path):
    """A token rotated on the sidecar refuses the old one's calls as AuthError, whichever
    meets the rotation first: a call or the heartbeat's keepalive (a refusal is not a lost
    host, and the link connection the sidecar closes after it is not reused)."""
    with running_sidecar(tmp_path, token=new_token()) as sc:
        with colocar.connect([sc.address], token=sc.token, heartbeat_seconds=3600) as cluster:
            host, session = cluster.hosts[0], cluster.hosts[0].connection.session
            echo = colocar.colocated(lambda x: x).on(host)
            assert echo(1) == 1
            rotated, fresh = new_token(), str(sc.token_file) + ".new"
            write_token_file(fresh, rotated)
            os.replace(fresh, sc.token_file)
            with colocar.connect([sc.address], token=rotated):  # the sidecar re-reads the file
                pass
            session.heartbeat()  # the keepalive meets the rotation first
            assert session.lost is None
            for _ in range(3):
                with pytest.raises(colocar.AuthError):
                    echo(2)
            assert session.lost is None


@pytest.mark.parametrize(
    "field, value, named",
    [("python_version", "2.7", "python"), ("cloudpickle_version", "0.0.1", "cloudpickle")],
)
def test_version_skew_is_refused_at_connect(sidecar, stub, field, value, named):
    session_id = uuid.uuid4().hex
    e = rpc_error(
        lambda: stub.Connect(
            connect_request(session_id, **{field: value}),
            metadata=token_metadata(sidecar.token),
            timeout=RPC_TIMEOUT,
        )
    )
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{named} {value} on the controller" in e.details()
    # No session was opened for it.
    ref = pb.SessionRef(session_id=session_id)
    assert not stub.Keepalive(ref, metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT).known


def test_controller_raises_version_skew_error(sidecar, monkeypatch):
    real = versions.local_versions()
    monkeypatch.setattr(versions, "local_versions", lambda: {**real, "python": "2.7"})
    threads = release_threads()
    with pytest.raises(colocar.VersionSkewError, match="python 2.7 on the controller"):
        colocar.connect([sidecar.address], token=sidecar.token, connect_timeout=RPC_TIMEOUT)
    wait_for(lambda: release_threads() == threads, "the failed connection's threads to end", timeout=15)


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
