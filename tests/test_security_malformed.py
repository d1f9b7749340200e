"""Garbage and malformed messages sent to a real sidecar are refused with a status code, never
take the server down, and leave no block leased.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import socket
from typing import Any

import grpc
import pytest
from helpers import wait_for
from security_helpers import (
    BENIGN_CODE,
    NO_ARGS,
    RPC_TIMEOUT,
    allocate,
    args_with_ref,
    assert_serving,
    code_fields,
    pool_usage,
    rpc_error,
    token_metadata,
)

from colocar.protocol import colocar_pb2 as pb

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
        assert_serving(sidecar, client)
        for s in sockets:
            with contextlib.suppress(OSError):  # the server may have closed it already
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                while s.recv(65536):
                    pass
    finally:
        for s in sockets:
            s.close()
    assert_serving(sidecar, client)


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
    md = token_metadata(sidecar.token)

    def send() -> Any:
        reply = call(data, metadata=md, timeout=RPC_TIMEOUT)
        return list(reply) if method == "Download" else reply

    e = rpc_error(send)
    assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), e
    assert_serving(sidecar, client)


def test_invalid_protobuf_in_client_streams_is_refused(sidecar, client, channel):
    md = token_metadata(sidecar.token)
    upload = channel.stream_unary("/colocar.v1.Sidecar/Upload")
    stream = channel.stream_stream("/colocar.v1.Sidecar/Stream")
    for data in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\x0f"):
        e = rpc_error(lambda data=data: upload(iter([data]), metadata=md, timeout=RPC_TIMEOUT))
        assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), e
        e = rpc_error(lambda data=data: list(stream(iter([data]), metadata=md, timeout=RPC_TIMEOUT)))
        assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), e
    assert_serving(sidecar, client)


BAD_PAYLOADS = {
    # name -> (args pickle, block descriptors) built from the session's own 4 KiB block `b`
    "unleased-block-id": lambda b: (NO_ARGS, [pb.BlockDesc(id=b.id + 10_000, offset=b.offset, nbytes=8)]),
    "wrong-offset": lambda b: (NO_ARGS, [pb.BlockDesc(id=b.id, offset=b.offset + 64, nbytes=8)]),
    "offset-outside-arena": lambda b: (NO_ARGS, [pb.BlockDesc(id=b.id, offset=2**63, nbytes=8)]),
    "nbytes-beyond-block": lambda b: (NO_ARGS, [pb.BlockDesc(id=b.id, offset=b.offset, nbytes=b.nbytes + 1)]),
    "reference-without-block": lambda b: (args_with_ref(0, (8,)), []),
    "reference-past-blocks": lambda b: (args_with_ref(3, (8,)), [b]),
    "array-larger-than-block": lambda b: (args_with_ref(0, (1 << 20,)), [b]),
    "negative-dimension": lambda b: (args_with_ref(0, (-1,)), [b]),
    "overflowing-shape": lambda b: (args_with_ref(0, (1 << 32, 1 << 32)), [b]),
    "object-dtype": lambda b: (args_with_ref(0, (4,), "O"), [b]),
    "garbage-pickle": lambda b: (b"\x80\x05garbage", []),
    "truncated-pickle": lambda b: (NO_ARGS[:-3], []),
}


@pytest.mark.parametrize("make", list(BAD_PAYLOADS.values()), ids=list(BAD_PAYLOADS))
def test_malformed_payloads_are_invalid_argument(sidecar, client, stub, session, make):
    used_before = pool_usage(stub, sidecar.token)
    block = allocate(stub, sidecar.token, session, 4096)
    args, blocks = make(block)
    request = pb.CallRequest(
        session_id=session,
        name="repr",
        args=pb.Payload(pickle=args, blocks=blocks),
        **code_fields(BENIGN_CODE),
    )
    md = token_metadata(sidecar.token)
    e = rpc_error(lambda: stub.Call(request, metadata=md, timeout=RPC_TIMEOUT))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    e = rpc_error(
        lambda: list(
            stub.Stream(iter([pb.StreamRequest(call=request, credits=1)]), metadata=md, timeout=RPC_TIMEOUT)
        )
    )
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert_serving(sidecar, client)
    # Refused requests leave no lease behind: once the session lets go of its block, it is free.
    release = pb.ReleaseRequest(session_id=session, block_ids=[block.id])
    stub.Release(release, metadata=md, timeout=RPC_TIMEOUT)
    wait_for(lambda: pool_usage(stub, sidecar.token) == used_before, "the block to be freed", timeout=10)


def test_hand_built_array_reference_is_understood(sidecar, stub, session):
    """Control for the cases above: the same hand-built reference, well formed, is accepted."""
    block = allocate(stub, sidecar.token, session, 4096)
    request = pb.CallRequest(
        session_id=session,
        name="repr",
        args=pb.Payload(pickle=args_with_ref(0, (2, 3), "int16"), blocks=[block]),
        **code_fields(BENIGN_CODE),
    )
    reply = stub.Call(request, metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT)
    assert not reply.HasField("error"), reply.error.traceback
    assert pickle.loads(reply.result.pickle).startswith("array([[")


def test_blocks_of_another_session_are_out_of_reach(sidecar, client, stub, session, other_session):
    md = token_metadata(sidecar.token)
    theirs = allocate(stub, sidecar.token, other_session, 4096)
    request = pb.CallRequest(
        session_id=session,
        name="repr",
        args=pb.Payload(pickle=args_with_ref(0, (512,)), blocks=[theirs]),
        consume_blocks=[theirs.id],
        **code_fields(BENIGN_CODE),
    )
    e = rpc_error(lambda: stub.Call(request, metadata=md, timeout=RPC_TIMEOUT))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "not leased by this session" in e.details()
    e = rpc_error(
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
    assert_serving(sidecar, client)


def test_unknown_session_is_failed_precondition(sidecar, client, stub):
    md = token_metadata(sidecar.token)
    sid = "never-connected"
    kw = {"metadata": md, "timeout": RPC_TIMEOUT}
    call = pb.CallRequest(
        session_id=sid, name="repr", args=pb.Payload(pickle=NO_ARGS), **code_fields(BENIGN_CODE)
    )
    attempts = {
        "Call": lambda: stub.Call(call, metadata=md, timeout=RPC_TIMEOUT),
        "Stream": lambda: list(stub.Stream(iter([pb.StreamRequest(call=call, credits=1)]), **kw)),
        "Allocate": lambda: stub.Allocate(pb.AllocateRequest(session_id=sid, sizes=[64]), **kw),
        "Upload": lambda: stub.Upload(iter([pb.Chunk(session_id=sid, total_bytes=1, data=b"x")]), **kw),
        "Download": lambda: list(stub.Download(pb.BlockRef(session_id=sid, block_id=1), **kw)),
        "Release": lambda: stub.Release(pb.ReleaseRequest(session_id=sid, block_ids=[1]), **kw),
    }
    for name, attempt in attempts.items():
        e = rpc_error(attempt)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "unknown session" in e.details(), name
    assert not stub.Keepalive(pb.SessionRef(session_id=sid), metadata=md, timeout=RPC_TIMEOUT).known
    assert_serving(sidecar, client)


def test_malformed_streams_and_uploads(sidecar, client, stub, session):
    md = token_metadata(sidecar.token)
    used_before = pool_usage(stub, sidecar.token)

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
        e = rpc_error(attempt)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.code(), e.details())
    too_big = {
        "upload": lambda: upload([pb.Chunk(session_id=session, total_bytes=1 << 40, data=b"x")]),
        "allocate": lambda: stub.Allocate(
            pb.AllocateRequest(session_id=session, sizes=[64, 1 << 62]), metadata=md, timeout=RPC_TIMEOUT
        ),
    }
    for name, attempt in too_big.items():
        e = rpc_error(attempt)
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (name, e.code(), e.details())
    e = rpc_error(
        lambda: stub.Call(
            pb.CallRequest(session_id=session, kind=pb.CallRequest.METHOD, object_id=12345, method="m"),
            metadata=md,
            timeout=RPC_TIMEOUT,
        )
    )
    assert e.code() == grpc.StatusCode.NOT_FOUND
    e = rpc_error(
        lambda: stub.Call(
            pb.CallRequest(session_id=session, name="f", code_hash=b"\x00" * 32),
            metadata=md,
            timeout=RPC_TIMEOUT,
        )
    )
    assert e.code() == grpc.StatusCode.NOT_FOUND and e.details().startswith("code:")
    # Every refused upload and allocation gave its blocks back.
    assert pool_usage(stub, sidecar.token) == used_before
    assert_serving(sidecar, client)
