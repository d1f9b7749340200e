"""Who may ship code to this sidecar: the token check and the address/TLS safety rules.

Shipped callables are code execution, so every RPC (except the standard health service)
must carry the sidecar's token, compared in constant time before anything is unpickled.
On gRPC the check runs on the call's metadata, before its message is read (`TokenInterceptor`):
a caller without the token costs neither the memory nor the parsing of what it sends.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import stat
import threading
import time

import grpc

from colocar.protocol.tokens import TOKEN_METADATA_KEY

HEALTH_PREFIX = "/grpc.health.v1.Health/"  # the standard health service: no token needed


class UnsafeConfigError(SystemExit):
    """The sidecar would accept code from the network without authentication."""


def read_token_file(path: str) -> str:
    """Reads a token file; refuses one that others can read, like ssh does with keys."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UnsafeConfigError(
            f"token file {path} is readable by group or others (mode {oct(mode & 0o777)}); "
            f"run: chmod 600 {path}"
        )
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise UnsafeConfigError(f"token file {path} is empty")
    return token


class Token:
    """The sidecar's token, re-read when its file changes: a rotated token (a pool's tenants
    file edited) takes effect within `poll` seconds, without a restart, and at once for a
    caller that already presents the new one (the file is re-read before a refusal).
    `generation` counts the changes: a local-link connection that proved an older one is
    refused from then on."""

    def __init__(self, value: str | None, path: str | None = None, poll: float = 1.0):
        self.value = value
        self.generation = 0
        self._path, self._poll = path, poll
        self._seen = file_stamp(path)
        self._lock = threading.Lock()
        if path:
            threading.Thread(target=self._watch, name="colocar-token-watch", daemon=True).start()

    def proven_by(self, given: bytes | None) -> int | None:
        """The generation of the token that `given` proves, or None when it proves none (a
        changed file is re-read once first, so a just-rotated token is not refused)."""
        for _ in range(2):
            value, generation = self.value, self.generation
            if value is None or (given is not None and hmac.compare_digest(given, value.encode())):
                return generation
            if not self._reload():
                return None
        return None

    def _watch(self) -> None:
        while True:  # a daemon thread: it ends with the sidecar
            time.sleep(self._poll)
            self._reload()

    def _reload(self) -> bool:
        """Re-reads the file if it changed; True when the token changed."""
        with self._lock:
            seen = file_stamp(self._path)
            if seen == self._seen:
                return False
            self._seen = seen
            try:
                value = read_token_file(self._path)  # type: ignore[arg-type]
            except (OSError, UnsafeConfigError) as e:  # the old token stays until a good one
                logging.getLogger("colocar.sidecar").warning("token file not reloaded: %s", e)
                return False
            if value == self.value:
                return False
            self.value, self.generation = value, self.generation + 1
        logging.getLogger("colocar.sidecar").info("token file %s changed: in use now", self._path)
        return True


def file_stamp(path: str | None) -> tuple[int, int, int] | None:
    """What tells that a file changed (its mtime, inode and size); None when it is absent."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ino, st.st_size) if st else None


def metadata_token(metadata: tuple | None) -> bytes | None:
    """The token a gRPC call carries in its metadata, or None."""
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            return value.encode() if isinstance(value, str) else value
    return None


def _refuse(_requests: object, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong colocar token")


# Takes the request stream without reading it: whatever the caller sends is never received.
_REFUSE = grpc.stream_unary_rpc_method_handler(_refuse)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses a call without the token from its metadata alone. gRPC reads a unary request
    only once its handler runs; the refusing handler takes the request stream and never reads
    it, so a stranger's message (up to the receive limit) is neither buffered nor parsed."""

    def __init__(self, token: Token):
        self._token = token

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method, metadata = handler_call_details.method or "", handler_call_details.invocation_metadata
        if method.startswith(HEALTH_PREFIX) or self._token.proven_by(metadata_token(metadata)) is not None:
            return continuation(handler_call_details)
        return _REFUSE


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost (with any port); unix sockets count as local."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address_safety(address: str, token: str | None, mutual_tls: bool) -> None:
    """Refuses to serve a non-loopback address without a token or client-certificate TLS."""
    if is_loopback(address) or token or mutual_tls:
        return
    raise UnsafeConfigError(
        f"refusing to listen on {address} without authentication: anyone who reaches it could "
        "run code here. Pass --token-file (and give the controller the same token), or "
        "--tls-cert/--tls-key with --tls-client-ca for mutual TLS. TLS without client "
        "certificates encrypts but does not authenticate."
    )


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None
) -> grpc.ServerCredentials | None:
    """TLS credentials, requiring client certificates when a client CA is given."""
    if not cert and not key:
        if client_ca:
            raise UnsafeConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise UnsafeConfigError("--tls-cert and --tls-key go together")
    with open(cert, "rb") as f:
        cert_bytes = f.read()
    with open(key, "rb") as f:
        key_bytes = f.read()
    ca_bytes = None
    if client_ca:
        with open(client_ca, "rb") as f:
            ca_bytes = f.read()
    return grpc.ssl_server_credentials(
        [(key_bytes, cert_bytes)],
        root_certificates=ca_bytes,
        require_client_auth=ca_bytes is not None,
    )
