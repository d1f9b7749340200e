"""Where the sidecars are and the token that reaches them: given, or from the environment.

Runs in the controller and in `colocar sessions` (no JAX): addresses from the argument, the
comma-separated `COLOCAR_SIDECARS`, or the job's connection file; the token from the
argument, a file, `COLOCAR_TOKEN_FILE`, `COLOCAR_TOKEN` or the connection file, in that order.
The connection file is what `colocar slurm run` publishes in the job's directory
(`$COLOCAR_JOB_DIR`, in an salloc shell `~/.colocar/slurm/$SLURM_JOB_ID`): a notebook or
terminal in the allocation connects with a bare `colocar.connect()`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from colocar.errors import ColocarError

CONNECTION_FILE = "connection.json"


def job_dir(job_id: int | str) -> str:
    """The default directory of Slurm job `job_id` (home is shared on most clusters)."""
    return os.path.expanduser(f"~/.colocar/slurm/{job_id}")


def _connection_path() -> str | None:
    folder = os.environ.get("COLOCAR_JOB_DIR") or (
        job_dir(os.environ["SLURM_JOB_ID"]) if os.environ.get("SLURM_JOB_ID") else None
    )
    return os.path.join(folder, CONNECTION_FILE) if folder else None


def published_connection() -> dict[str, Any] | None:
    """The job's connection file ({"sidecars": [...], "token_file": ...}), if there is one."""
    path = _connection_path()
    if path is None:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def sidecar_addresses(addresses: str | Sequence[str] | None) -> list[str]:
    """The addresses given (a list, or comma-separated), else those of `COLOCAR_SIDECARS`, else
    the job's connection file."""
    if addresses is None:
        addresses = os.environ.get("COLOCAR_SIDECARS", "")
        published = None if addresses else published_connection()
        if published is not None:
            addresses = list(published["sidecars"])
    if isinstance(addresses, str):
        addresses = [a.strip() for a in addresses.split(",") if a.strip()]
    if not addresses:
        where = _connection_path()
        raise ColocarError(
            "no sidecar addresses: pass connect([...]) or set COLOCAR_SIDECARS=host:port,..."
            + (f" (no {where} either: are the job's sidecars up?)" if where else "")
        )
    return list(addresses)


def token_from_env(token: str | None, token_file: str | None) -> str | None:
    """The token given, else the one in `token_file` or `COLOCAR_TOKEN_FILE`, else `COLOCAR_TOKEN`."""
    if token:
        return token
    token_file = token_file or os.environ.get("COLOCAR_TOKEN_FILE")
    if not token_file and not os.environ.get("COLOCAR_TOKEN"):
        published = published_connection()
        token_file = published.get("token_file") if published else None
    if token_file:
        with open(token_file) as f:
            return f.read().strip()
    return os.environ.get("COLOCAR_TOKEN") or None
