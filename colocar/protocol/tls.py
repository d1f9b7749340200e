"""gRPC channel credentials from PEM files: the controller's and the sidecars' peer channels."""

from __future__ import annotations

from typing import Any


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> Any:
    """`grpc.ChannelCredentials` from the CA, certificate and key files (a client certificate
    for mutual TLS), or None without TLS (neither a CA nor a certificate given)."""
    if not (ca or cert):
        return None
    import grpc

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
