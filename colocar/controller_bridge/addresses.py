"""Where the sidecars are and the token that reaches them: given, or from the environment.

Runs in the controller and in `colocar sessions` (no JAX): addresses from the argument or the
comma-separated `COLOCAR_SIDECARS`, the token from the argument, a file, `COLOCAR_TOKEN_FILE`
or `COLOCAR_TOKEN`, in that order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from colocar.errors import ColocarError


def sidecar_addresses(addresses: str | Sequence[str] | None) -> list[str]:
    """The addresses given (a list, or comma-separated), else those of `COLOCAR_SIDECARS`."""
    if addresses is None:
        addresses = os.environ.get("COLOCAR_SIDECARS", "")
    if isinstance(addresses, str):
        addresses = [a.strip() for a in addresses.split(",") if a.strip()]
    if not addresses:
        raise ColocarError("no sidecar addresses: pass connect([...]) or set COLOCAR_SIDECARS=host:port,...")
    return list(addresses)


def token_from_env(token: str | None, token_file: str | None) -> str | None:
    """The token given, else the one in `token_file` or `COLOCAR_TOKEN_FILE`, else `COLOCAR_TOKEN`."""
    if token:
        return token
    token_file = token_file or os.environ.get("COLOCAR_TOKEN_FILE")
    if token_file:
        with open(token_file) as f:
            return f.read().strip()
    return os.environ.get("COLOCAR_TOKEN") or None
