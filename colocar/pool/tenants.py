"""The tenants file of a shared pool: who may use it, with which token, priority and quotas.

Runs in the pool's agent. The file is YAML, one entry per tenant:

    tenants:
      alice:
        token_file: alice.token      # mode 0600; relative to this file
        priority: 10                 # the admission queue serves higher first (default 0)
        quotas: {arena: 1G, calls: 16, processes: 2, sessions: 4}

`TenantsFile` re-reads it when it changes (checked every second): a new tenant may connect at
once, a removed one's sidecars stop, a rotated token is in use within a second. A file that
does not parse keeps the last good one (the error is logged and shown by `colocar pool status`).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import yaml

from colocar.errors import ColocarError
from colocar.sidecar.auth import UnsafeConfigError, file_stamp, read_token_file
from colocar.sizes import parse_size

log = logging.getLogger("colocar.pool")
QUOTA_KEYS = ("arena", "calls", "processes", "sessions")
DEFAULT_QUOTAS = {"arena": 256 << 20, "calls": 16, "processes": 1, "sessions": 4}


class TenantsFileError(ColocarError):
    """The tenants file cannot be read or says something invalid (the message names the entry)."""


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, token, priority and quotas (arena in bytes, per host)."""

    name: str
    token: str
    token_file: str
    priority: int
    arena: int
    calls: int
    processes: int
    sessions: int

    def quotas(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in QUOTA_KEYS}


def parse(text: str, folder: str) -> dict[str, Tenant]:
    """The tenants `text` names (token files relative to `folder`); TenantsFileError if invalid."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise TenantsFileError(f"not YAML: {e}") from None
    entries = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise TenantsFileError("expected a mapping 'tenants:' of tenant names to their entries")
    tenants = {str(name): _tenant(str(name), entry, folder) for name, entry in entries.items()}
    tokens = [t.token for t in tenants.values()]
    if len(set(tokens)) != len(tokens):
        raise TenantsFileError("two tenants share a token: each needs its own")
    return tenants


def _tenant(name: str, entry: Any, folder: str) -> Tenant:
    if not name.replace("-", "").replace("_", "").isalnum():
        raise TenantsFileError(f"tenant {name!r}: a name has letters, digits, '-' and '_' only")
    if not isinstance(entry, dict) or "token_file" not in entry:
        raise TenantsFileError(f"tenant {name!r}: needs token_file (a 0600 file holding its token)")
    unknown = set(entry) - {"token_file", "priority", "quotas"}
    quotas = entry.get("quotas") or {}
    unknown |= {f"quotas.{k}" for k in set(quotas) - set(QUOTA_KEYS)} if isinstance(quotas, dict) else set()
    if unknown or not isinstance(quotas, dict):
        raise TenantsFileError(
            f"tenant {name!r}: unknown keys {sorted(unknown)} (quotas: {', '.join(QUOTA_KEYS)})"
        )
    path = os.path.join(folder, str(entry["token_file"]))
    try:
        token = read_token_file(path)
    except (OSError, UnsafeConfigError) as e:
        raise TenantsFileError(f"tenant {name!r}: token_file {path}: {e}") from None
    values = {**DEFAULT_QUOTAS, **quotas}
    try:
        values["arena"] = parse_size(str(values["arena"]))
        numbers = {k: int(values[k]) for k in QUOTA_KEYS}
        priority = int(entry.get("priority", 0))
    except (TypeError, ValueError) as e:
        raise TenantsFileError(f"tenant {name!r}: {e}") from None
    if min(numbers.values()) < (0 if numbers["processes"] == 0 else 1) or numbers["arena"] <= 0:
        raise TenantsFileError(f"tenant {name!r}: quotas must be positive (processes may be 0): {numbers}")
    return Tenant(name, token, path, priority, **numbers)


class TenantsFile:
    """The tenants of `path`, re-read when it changes; `on_change(old, new)` runs after a
    change (in the watching thread)."""

    def __init__(self, path: str, on_change: Any = None, poll: float = 1.0):
        self.path = os.path.abspath(path)
        self.error = ""
        self._on_change = on_change
        self.tenants: dict[str, Tenant] = {}
        self._seen = self._stamp()
        self.tenants = self._read()  # the first read must succeed: the pool does not start without
        self._seen = self._stamp()
        self._stop = threading.Event()
        self._poll = poll
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="colocar-tenants-watch", daemon=True).start()

    def _stamp(self) -> list[tuple[int, int, int] | None]:
        """What tells a change: the file's and its tenants' token files' times, inodes, sizes."""
        return [file_stamp(p) for p in (self.path, *(t.token_file for t in self.tenants.values()))]

    def _read(self) -> dict[str, Tenant]:
        try:
            with open(self.path) as f:
                text = f.read()
        except OSError as e:
            raise TenantsFileError(f"tenants file {self.path}: {e.strerror}") from None
        try:
            return parse(text, os.path.dirname(self.path))
        except TenantsFileError as e:
            raise TenantsFileError(f"tenants file {self.path}: {e}") from None

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            self._refresh()

    def _refresh(self) -> bool:
        """Re-reads the file if it or a token file changed; True when it did."""
        with self._lock:
            stamp = self._stamp()
            if stamp == self._seen:
                return False
            self._seen = stamp  # stamped before the read: a change during it is seen next time
            self._reload()
            return True

    def _reload(self) -> None:
        """Reads the file again; keeps the tenants it had when it does not parse."""
        try:
            new = self._read()
        except TenantsFileError as e:
            self.error = str(e)
            log.warning("%s; the tenants stay as they were", e)
            return
        old, self.tenants, self.error = self.tenants, new, ""
        if old != new:
            log.info("tenants file reloaded: %s", ", ".join(sorted(new)) or "no tenants")
            if self._on_change is not None:
                self._on_change(old, new)

    def who(self, token: str) -> Tenant | None:
        """The tenant holding `token` (compared in constant time with every tenant's); a
        changed file is re-read before an unknown token is refused, so a token just written
        is known at once."""
        found = self._holder(token)
        if found is None and self._refresh():
            found = self._holder(token)
        return found

    def _holder(self, token: str) -> Tenant | None:
        found = None
        for tenant in self.tenants.values():
            if hmac.compare_digest(tenant.token.encode(), token.encode()):
                found = tenant
        return found

    def close(self) -> None:
        self._stop.set()
