"""The writer lease of a checkpoint directory: one manager writes it at a time (controller).

The lease is a small object (`writer.json`: owner id, hostname, pid) created create-only and
refreshed every `seconds / 4` by a thread while the manager lives. Another manager finding a
lease younger than `seconds` is refused; an older one is stale (its holder died) and taken over.
A holder that could not refresh for a while (its process was paused) checks that the lease is
still its own before it saves again.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from colocar.errors import CheckpointError

from . import layout
from .storage import Storage


class WriterLease:
    def __init__(self, storage: Storage, owner: str, seconds: float):
        self.storage = storage
        self.owner = owner
        self.seconds = seconds
        self.lost = ""  # why the lease was lost to another writer, if it was
        self._refreshed = 0.0  # monotonic time of the last write of the lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        holder = {
            "owner": self.owner,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
        }
        return json.dumps(holder).encode()

    def _holder(self) -> dict:
        return json.loads(self.storage.read(layout.WRITER_LEASE) or b"{}")

    def acquire(self) -> None:
        """Takes the lease (once), or raises CheckpointError naming the live holder. Held already
        but not refreshed lately (the process was paused, or storage was slow), it first checks
        that no other writer took it over meanwhile."""
        if self._thread is not None:
            if time.monotonic() - self._refreshed > self.seconds / 2:
                self._confirm()
            return
        if not self.storage.write(layout.WRITER_LEASE, self._body(), create_only=True):
            holder = self._holder()
            age = self.storage.age(layout.WRITER_LEASE)
            if holder.get("owner") != self.owner and age is not None and age < self.seconds:
                raise CheckpointError(
                    f"{self.storage.url} is being written by another CheckpointManager (pid "
                    f"{holder.get('pid')} on {holder.get('hostname')}, seen {age:.0f} s ago); two writers "
                    f"would destroy each other's steps. Stop it, write elsewhere, or wait until its "
                    f"lease is {self.seconds:.0f} s old"
                )
            self.storage.write(layout.WRITER_LEASE, self._body())  # a stale lease: take it over
        self._refreshed = time.monotonic()
        self._thread = threading.Thread(target=self._refresh, name="colocar-ckpt-lease", daemon=True)
        self._thread.start()

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
        """Stops refreshing and deletes the lease if it is still ours (best effort)."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=5)
        try:
            if self._holder().get("owner") == self.owner:
                self.storage.delete(layout.WRITER_LEASE)
        except Exception:
            pass
