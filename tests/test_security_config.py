"""Unsafe sidecar configurations refuse to start before creating an arena, and the local link
(a Unix socket) is private and checks the token.
"""

from __future__ import annotations

import os
import socket
import stat

import grpc
import pytest
from security_helpers import (
    DEADLINE,
    run_sidecar,
    sidecar_argv,
)

import colocar
from colocar.protocol import link
from colocar.protocol.tokens import new_token, write_token_file

# --- 4. unsafe configurations ------------------------------------------------------------------


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", ":0", "10.255.255.1:0", "localhost.example:0"])
def test_network_address_without_auth_refuses_to_start(tmp_path, address):
    shm = tmp_path / "shm"
    shm.mkdir()
    done = run_sidecar(sidecar_argv("--address", address, shm_dir=str(shm)))
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
    done = run_sidecar(
        sidecar_argv("--address", "0.0.0.0:0", "--token-file", str(token_file), shm_dir=str(shm))
    )
    assert done.returncode != 0
    assert f"chmod 600 {token_file}" in done.stderr
    assert os.listdir(shm) == []


def test_empty_token_file_is_refused(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    token_file = tmp_path / "token"
    write_token_file(str(token_file), "  \n")
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    done = run_sidecar(
        sidecar_argv("--address", "0.0.0.0:0", "--token-file", str(token_file), shm_dir=str(shm))
    )
    assert done.returncode != 0 and "is empty" in done.stderr
    assert os.listdir(shm) == []


# --- 8. the local link --------------------------------------------------------------------------
def test_local_link_is_private_and_checks_the_token(cluster):
    conn = cluster.hosts[0].connection
    assert conn.transport.link is not None, "a same-host controller uses the local link"
    path = conn.session.info.link_path
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
        sock.connect(conn.session.info.link_path)
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
