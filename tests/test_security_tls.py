"""Mutual TLS: a sidecar that requires client certificates serves trusted clients only, and
TLS without client certificates is refused off loopback.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from security_helpers import (
    RPC_TIMEOUT,
    Sidecar,
    assert_serving,
    rpc_error,
    run_sidecar,
    running_sidecar,
    sidecar_argv,
)

import colocar
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc


@dataclass
class Pki:
    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    rogue_cert: pathlib.Path  # signed by a CA the sidecar does not trust
    rogue_key: pathlib.Path


def _name(common: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: Any, path: pathlib.Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _issue(
    subject: str,
    key: Any,
    issuer: Any,
    issuer_key: Any,
    *,
    now: datetime.datetime,
    ca: bool,
    usage: Any = None,
    sans: list[Any] | None = None,
) -> Any:
    """A certificate for `subject`, valid from an hour before `now` to a day after."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
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


def _pem(cert: Any, path: pathlib.Path) -> pathlib.Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    root = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.UTC)
    files: dict[str, pathlib.Path] = {}
    cas = {}
    for ca_name in ("ca", "rogue-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"colocar test {ca_name}", key, _name(f"colocar test {ca_name}"), key, now=now, ca=True)
        cas[ca_name] = (cert, key)
        files[ca_name] = _pem(cert, root / f"{ca_name}.pem")
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
        cert = _issue(leaf, key, ca_cert.subject, ca_key, now=now, ca=False, usage=usage, sans=sans)
        files[leaf] = _pem(cert, root / f"{leaf}.pem")
        files[f"{leaf}-key"] = root / f"{leaf}.key"
        _write_key(key, files[f"{leaf}-key"])
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
        assert_serving(tls_sidecar, cluster)
        # The session's liveness probe (after an unanswered keepalive) passes mutual TLS too.
        assert cluster.hosts[0].connection.grpc.accepts_connections(RPC_TIMEOUT)


def _tls_stats(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError:
    ch = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with ch:
        return rpc_error(lambda: pb_grpc.SidecarStub(ch).Stats(pb.Empty(), timeout=RPC_TIMEOUT))


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
    done = run_sidecar(sidecar_argv("--address", "0.0.0.0:0", *tls, shm_dir=str(shm)))
    assert done.returncode != 0 and "does not authenticate" in done.stderr
    done = run_sidecar(
        sidecar_argv("--address", "127.0.0.1:0", "--tls-client-ca", str(pki.ca), shm_dir=str(shm))
    )
    assert done.returncode != 0 and "--tls-client-ca needs --tls-cert" in done.stderr
    assert os.listdir(shm) == []
