"""Waits in jax.distributed's key-value store that end soon after the awaited process died (controller).

Under multi-controller JAX a process waits for another's key (a snapshot exchange, an array
call's outputs, a loader's check) with `blocking_key_value_get`. If that process died (SIGKILL,
OOM), the wait lasts its whole timeout (300 s) unless jax.distributed ends it first, which it
does at once only when process 0 (its coordination service) died, else after its heartbeat
timeout (100 s by default). So every process that takes part beats: a daemon thread sets
`colocar/alive/<process>` to a new count every `BEAT_SECONDS`; `get` waits in slices and, in
between, reads the beat of the process it waits for. A beat seen standing still for
`lost_seconds()` ($COLOCAR_PROCESS_LOST_SECONDS, default 10) raises `ProcessLostError`, which
the elastic manager takes for a loss (the trainers exit and are restarted). A process never
seen beating is waited for as before, up to the timeout. A process that exits (a crash's
traceback, or its end) stops beating and says so first (`EXITED`), before jax.distributed's
shutdown barrier, where it would otherwise wait for the others as they wait for it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

import jax

from colocar.errors import ProcessLostError

BEAT_SECONDS = 1.0
SLICE_SECONDS = 0.5  # the longest a wait goes without looking at the awaited process's beat
DEFAULT_LOST_SECONDS = 10.0  # a few beats, and a margin for a loaded machine's late thread
PREFIX = "colocar/alive"
EXITED = "exited"

_lock = threading.Lock()
_client: list[Any] = []  # the client this process beats on (a new one replaces it)
_seen: dict[tuple[int, int], tuple[str, float]] = {}  # (client, process) -> (beat, seen changing)


def lost_seconds() -> float:
    """How long a process's beat must stand still before it counts as gone."""
    value = os.environ.get("COLOCAR_PROCESS_LOST_SECONDS")
    return float(value) if value else DEFAULT_LOST_SECONDS


def beat(client: Any) -> None:
    """Makes sure this process beats on `client`; its first beat is set before this returns,
    so a peer can tell this process's death from then on."""
    with _lock:
        if _client and _client[0] is client:
            return
        _client[:] = [client]
    me = jax.process_index()
    if _set(client, me, 0):
        threading.Thread(target=_beat, args=(client, me), name="colocar-alive", daemon=True).start()
        atexit.register(_exit, client, me)  # runs before jax.distributed's shutdown (registered earlier)


def _set(client: Any, me: int, n: int | str) -> bool:
    """Sets this process's beat, unless a newer client took over or the process exits."""
    with _lock:
        if not _client or _client[0] is not client:
            return False
        try:
            client.key_value_set(f"{PREFIX}/{me}", str(n), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the store is gone (shut down; a dead coordinator ends us)
            return False
        if n == EXITED:
            _client.clear()
        return True


def _beat(client: Any, me: int) -> None:
    n = 1
    while _set(client, me, n):
        n += 1
        time.sleep(BEAT_SECONDS)


def _exit(client: Any, me: int) -> None:
    """This process ends: its peers stop waiting for it at once."""
    _set(client, me, EXITED)


def get(client: Any, key: str, owner: int, timeout: float) -> str:
    """`key`'s value, which process `owner` sets, within `timeout` s (else jax.distributed's
    DEADLINE_EXCEEDED error); raises `ProcessLostError` once `owner`'s beat stood still for
    `lost_seconds()`."""
    beat(client)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        wait = min(SLICE_SECONDS, left)
        try:
            return str(client.blocking_key_value_get(key, max(1, int(wait * 1000))))
        except Exception as e:
            if wait >= left or "DEADLINE_EXCEEDED" not in str(e):
                raise
        check(client, owner)


def check(client: Any, owner: int) -> None:
    """Raises `ProcessLostError` when process `owner`'s beat stood still for `lost_seconds()`
    (as seen from here: the first look only notes it)."""
    if owner == jax.process_index():
        return
    try:
        value = str(client.key_value_try_get(f"{PREFIX}/{owner}"))
    except Exception:  # noqa: BLE001 - not beating (yet): nothing to tell
        return
    now = time.monotonic()
    with _lock:
        seen = _seen.get((id(client), owner))
        if seen is None or seen[0] != value:
            _seen[(id(client), owner)] = (value, now)
            return
    still = now - seen[1]
    if value == EXITED:
        raise ProcessLostError(
            f"JAX process {owner} has exited (its liveness beat {PREFIX}/{owner} says so) while this "
            "process waits for it. A multi-controller job cannot go on without it: every trainer must "
            "exit and be restarted"
        )
    if still >= lost_seconds():
        raise ProcessLostError(
            f"JAX process {owner} is gone: its liveness beat ({PREFIX}/{owner} in jax.distributed's "
            f"key-value store) has not changed for {still:.0f} s. A multi-controller job cannot go on "
            "without it: every trainer must exit and be restarted"
        )
