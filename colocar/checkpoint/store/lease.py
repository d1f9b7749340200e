"""The writer lease of a checkpoint directory: one manager writes it at a time (controller).

The lease is a small object (`writer.json`: owner id, hostname, pid) created create-only and
refreshed every `seconds / 4` by a thread while the manager lives. Another manager finding a
lease younger than `seconds` is refused, unless its holder is provably dead: same host and PID
namespace, and its process is gone; or its session on a sidecar this manager also reaches has
ended (a trainer restarted in a new container: the sidecar saw the old one's session lapse).
Then, as for an older (stale) lease, it takes it over at once; a save that finds the holder's
session still alive but silent waits for it to lapse (at most the session's lease). A manager
learns at creation whether a live holder will refuse or delay its saves (`conflict`).
A holder that could not refresh for a while (its process was paused) checks that the lease is
still its own before it saves again. The writers of an earlier holder are fenced by the new
one (see `fencing`). Closing a manager marks its lease released instead of deleting it: the
next manager takes it at once, and writers of earlier holders stay fenced.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

from colocar.controller_bridge.func import colocated
from colocar.errors import CheckpointError
from colocar.sidecar import sessions

from ..format import layout
from .storage import Storage


def _start_of_this_process() -> dict[str, Any]:
    import psutil  # here, not at the top: the controller imports this module at start

    from colocar import pids

    try:
        return pids.start_of(os.getpid())
    except (psutil.Error, OSError):  # nothing to read it from: never taken for dead, then
        return {}


def is_dead(holder: dict[str, Any]) -> bool:
    """True when the holder's process provably ended: it ran on this host, in this PID
    namespace, and its PID is gone or now names a process started later."""
    pid = holder.get("pid")
    if holder.get("hostname") != socket.gethostname() or not isinstance(pid, int):
        return False
    import psutil

    from colocar import pids

    if holder.get("pidns", "") != pids.pid_namespace():
        return False  # another container with the same host name: its PIDs are not ours
    if not psutil.pid_exists(pid):
        return True
    return isinstance(holder.get("started"), int | float) and pids.process_with(pid, holder) is None


_ask_session = colocated(sessions.seconds_left)  # runs in the sidecar (a module without JAX)


class WriterLease:
    def __init__(self, storage: Storage, owner: str, seconds: float, hosts: list[Any] | None = None):
        self.storage = storage
        self.owner = owner
        self.seconds = seconds
        self.hosts = hosts or []  # the manager's hosts: the first names it in the lease
        self.lost = ""  # why the lease was lost to another writer, if it was
        self._refreshed = 0.0  # monotonic time of the last write of the lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self, released: bool = False) -> bytes:
        holder = {
            "owner": self.owner,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            **_start_of_this_process(),
            "time": time.time(),
            "released": released,
        }
        if self.hosts:  # the session a sidecar can vouch for (see `_session_left`)
            holder["sidecar"] = self.hosts[0].address
            holder["session"] = self.hosts[0].connection.session.session_id
        return json.dumps(holder).encode()

    def _holder(self) -> dict:
        return layout.holder_of(self.storage)

    def _session_left(self, holder: dict[str, Any]) -> float | None:
        """Seconds until the holder's controller session lapses on its sidecar (0.0: it ended,
        the holder is gone), or None when no sidecar of this manager can tell."""
        host = next((h for h in self.hosts if h.address == holder.get("sidecar")), None)
        if host is None or not isinstance(holder.get("session"), str):
            return None
        try:
            left = _ask_session.on(host)(holder["session"])
        except Exception:
            return None
        return 0.0 if left is None else float(left)

    def conflict(self) -> tuple[str, float]:
        """Why `acquire` would refuse now (a live holder's fresh lease; "" when it would not),
        and how long it would first wait for the holder's silent session to lapse."""
        holder = self._holder()
        if not holder or holder.get("owner") == self.owner or holder.get("released") or is_dead(holder):
            return "", 0.0
        age = self.storage.age(layout.WRITER_LEASE)
        if age is None or age >= self.seconds:
            return "", 0.0
        left = self._session_left(holder)
        if left == 0.0:
            return "", 0.0  # its sidecar saw its session end: the holder is gone
        why = (
            f"{self.storage.url} is being written by another CheckpointManager (pid "
            f"{holder.get('pid')} on {holder.get('hostname')}, seen {age:.0f} s ago); two writers "
            f"would destroy each other's steps. Stop it, write elsewhere, or wait until its "
            f"lease is {self.seconds:.0f} s old"
        )
        return why, (left or 0.0)

    def acquire(self) -> bool:
        """Takes the lease (once; True then), or raises CheckpointError naming the live holder.
        Held already but not refreshed lately (the process was paused, or storage was slow), it
        first checks that no other writer took it over meanwhile."""
        if self._thread is not None:
            if time.monotonic() - self._refreshed > self.seconds / 2:
                self._confirm()
            return False
        if not self.storage.write(layout.WRITER_LEASE, self._body(), create_only=True):
            refused, wait = self.conflict()
            if refused and wait:  # its session is alive on our sidecar: once, wait for it to lapse
                time.sleep(wait + 0.5)
                refused, _ = self.conflict()
            if refused:
                raise CheckpointError(refused)
            self.storage.write(layout.WRITER_LEASE, self._body())  # stale, or its holder died: take it over
        self._refreshed = time.monotonic()
        self._thread = threading.Thread(target=self._refresh, name="colocar-ckpt-lease", daemon=True)
        self._thread.start()
        return True

    def _confirm(self) -> None:
        """Refreshes the lease if it is still ours; raises CheckpointError if it is not."""
        holder = self._holder()
        if holder.get("owner") not in (None, self.owner):
            self.lost = (
                f"another CheckpointManager (pid {holder.get('pid')} on {holder.get('hostname')}) "
                f"took over {self.storage.url} after this one's lease went stale; not saving"
            )
            raise CheckpointError(self.lost)
        self.storage.write(layout.WRITER_LEASE, self._body())
        self._refreshed = time.monotonic()

    def _refresh(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            try:
                self._confirm()
            except CheckpointError:
                return
            except Exception:
                pass  # storage trouble: the saves report it; the lease just ages

    def release(self) -> None:
        """Stops refreshing and marks the lease released if it is still ours (best effort). It
        keeps naming this manager, so writers of earlier holders that still run stay fenced."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=5)
        try:
            if self._holder().get("owner") == self.owner:
                self.storage.write(layout.WRITER_LEASE, self._body(released=True))
        except Exception:
            pass
