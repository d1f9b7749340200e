"""The shared secret that authenticates controllers to sidecars (used by both sides).

Every RPC carries it in the `x-colocar-token` metadata entry (and the local link in its first
frame); it is kept in files readable by their owner only.
"""

from __future__ import annotations

import os
import secrets

TOKEN_METADATA_KEY = "x-colocar-token"


def new_token() -> str:
    return secrets.token_hex(32)


def write_token_file(path: str, token: str) -> None:
    """Writes a token readable by the owner only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
