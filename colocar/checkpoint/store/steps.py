"""The step directories under a checkpoint root and what their markers say (controller, sidecar
writer and the `colocar ckpt` command; no JAX).

`StepDirs` answers every question about the steps of a root in one place, so that the manager,
the writers and the command agree on them: which steps are committed (a `COMMITTED` marker),
how a step is deleted (that marker first: never half-restorable), when an uncommitted step is
abandoned (no sign of life for `STALE_SECONDS`), which hosts finished or failed a save
`attempt`, and what removing a failed save's leftovers means. A save's objects lie under its
attempt's directory (see `layout`); the commit marker names the attempt a restore reads.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from colocar.errors import CheckpointError

from ..format import layout
from .storage import Storage

STALE_SECONDS = 60.0  # an uncommitted step without a fresher heartbeat is abandoned (debris)


class ManifestError(ValueError):
    """A step's manifest cannot be read as JSON: the step cannot be restored or listed."""


class StepDirs:
    """The `step_<N>` directories of one storage root (colocar's format; Orbax's layout:
    `orbax.steps.OrbaxSteps`, the same questions answered for its directories)."""

    layout = "colocar"

    def __init__(self, storage: Storage):
        self.storage = storage

    # --- where a save's arrays lie --------------------------------------------------------------
    def write_spec(self, step: int, attempt: str, host: int, entry: dict[str, Any]) -> dict[str, Any]:
        """The tensorstore spec host `host` writes an array leaf's entry of save `attempt` with."""
        kvstore = self.storage.kvstore(f"{layout.attempt_dir(step, attempt)}/{entry['array_dir']}")
        return layout.entry_spec(kvstore, entry)

    def read_spec(self, step: int, manifest: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
        """The tensorstore spec a restore reads an array leaf's entry of committed `step` with."""
        name = f"{layout.arrays_root(step, manifest)}/{layout.array_name(manifest, entry)}"
        return layout.read_spec(self.storage.kvstore(name))

    def arrays_root(self, step: int, manifest: dict[str, Any]) -> str:
        """Where a step's arrays lie, as people read it (`colocar ckpt show`)."""
        return layout.arrays_root(step, manifest)

    def heartbeat_name(self, step: int, attempt: str) -> str:
        """The object a save in progress rewrites to show it is alive."""
        return self._name(step, layout.HEARTBEAT)

    def remove_debris(self, step: int) -> None:
        """Deletes what an abandoned, uncommitted save of `step` left."""
        self.storage.delete_tree(layout.step_dir(step))

    # --- listing ------------------------------------------------------------------------------
    def all(self) -> list[int]:
        """Every step directory, ascending (committed or not)."""
        return sorted(s for s in map(layout.parse_step_dir, self.storage.children()) if s is not None)

    def committed(self, steps: list[int] | None = None) -> list[int]:
        """The committed ones of `steps` (default: all), ascending."""
        return [s for s in (self.all() if steps is None else steps) if self.is_committed(s)]

    def is_committed(self, step: int) -> bool:
        return self.storage.exists(self._name(step, layout.COMMITTED))

    def committed_attempt(self, step: int) -> str | None:
        """The attempt the commit marker of `step` names (None: not committed, or unreadable)."""
        try:
            body = json.loads(self.storage.read(self._name(step, layout.COMMITTED)) or b"null")
        except ValueError:
            return None
        return str(body["attempt"]) if isinstance(body, dict) and body.get("attempt") else None

    def attempts(self, step: int) -> list[str]:
        """The attempts that wrote something under `step`."""
        names = self.storage.children(layout.step_dir(step))
        return [a for a in map(layout.parse_attempt_dir, names) if a]

    def manifest(self, step: int) -> bytes | None:
        """The manifest of the attempt that committed `step` (uncommitted: of the attempt that
        showed life last), or of a format-1 step; None when there is none."""
        attempt = self.committed_attempt(step)
        if attempt is None and not self.is_committed(step):
            ages = [(self.storage.age(self._manifest(step, a)), a) for a in self.attempts(step)]
            alive = sorted((age, a) for age, a in ages if age is not None)
            attempt = alive[0][1] if alive else None
        if attempt is not None:
            body = self.storage.read(self._manifest(step, attempt))
            if body is not None:
                return body
        return self.storage.read(self._name(step, layout.MANIFEST))  # format 1

    def read_manifest(self, step: int) -> dict[str, Any] | None:
        """The parsed manifest of `step` (None: it has none yet); raises ManifestError naming
        the object when it is not a JSON object (a truncated write, a damaged object)."""
        body = self.manifest(step)
        if body is None:
            return None
        try:
            manifest = json.loads(body)
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise ManifestError(self._unreadable(step, f"{len(body)} bytes, not JSON: {e}")) from None
        if not isinstance(manifest, dict):
            raise ManifestError(self._unreadable(step, f"a JSON {type(manifest).__name__}, not an object"))
        return manifest

    def committed_manifest(self, step: int | None) -> tuple[int, dict[str, Any]]:
        """`step` (default: the latest committed one) and its manifest; raises CheckpointError
        when it is not committed or its manifest is missing, unreadable (naming an older step
        to pick when the caller named none) or of an unknown format."""
        latest = step is None
        if step is None:
            committed = self.committed()
            if not committed:
                raise CheckpointError(f"no committed checkpoint in {self.storage.url}")
            step = committed[-1]
        elif not self.is_committed(step):
            raise CheckpointError(
                f"step {step} is not a committed checkpoint in {self.storage.url} "
                f"(committed: {self.committed()})"
            )
        try:
            manifest = self.read_manifest(step)
        except ManifestError as e:
            raise CheckpointError(f"{e}{self.older_than(step) if latest else ''}") from None
        if manifest is None:
            raise CheckpointError(f"step {step} in {self.storage.url} has no manifest (corrupted)")
        if manifest.get("format") not in layout.READABLE_FORMATS:
            raise CheckpointError(f"step {step}: unknown format {manifest.get('format')!r}")
        layout.array_layout(manifest)  # an unknown one fails here, before anything is read
        return step, manifest

    def older_than(self, step: int) -> str:
        """What a user whose latest committed step is broken can do instead."""
        return older_than(self.committed(), step)

    def _unreadable(self, step: int, why: str) -> str:
        name = f"{self.storage.url}/{self._name(step, layout.MANIFEST)}"
        return f"step {step}: its manifest {name} is unreadable ({why})"

    def age(self, step: int) -> float | None:
        """Seconds since the save of `step` last showed life: its heartbeat, else its manifest."""
        age = self.storage.age(self._name(step, layout.HEARTBEAT))
        return age if age is not None else self.storage.age(self._name(step, layout.MANIFEST))

    def is_abandoned(self, step: int, stale_seconds: float, latest: int | None = None) -> bool:
        """Uncommitted `step` is debris: silent for `stale_seconds`, or never alive and older
        than `latest` (a committed step; None: any step never alive counts as abandoned)."""
        age = self.age(step)
        if age is None:
            return latest is None or step < latest
        return age > stale_seconds

    def status(self, step: int, stale_seconds: float = STALE_SECONDS) -> str:
        """The step as people read it: committed, abandoned or "in progress (N s ago)"."""
        if self.is_committed(step):
            return "committed"
        if self.is_abandoned(step, stale_seconds):
            return "abandoned"
        return f"in progress ({self.age(step) or 0.0:.0f} s ago)"

    # --- deleting -----------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Deletes a step: its commit marker first, so it is never half-restorable."""
        self.storage.delete(self._name(step, layout.COMMITTED))
        self.storage.delete_tree(layout.step_dir(step))

    def clear_failed_save(self, step: int) -> None:
        """Removes what a failed format-1 save of uncommitted `step` left directly in the step.
        A failed save's attempt directory stays until a new save of the step commits
        (`clear_other_attempts`): its writers may still be running, and they cannot touch
        another attempt's objects anyway."""
        if not self.storage.children(layout.step_dir(step)):
            return
        self.storage.delete(self._name(step, layout.MANIFEST))
        for directory in (layout.DONE_DIR, layout.FAILED_DIR, layout.ARRAYS_DIR):
            self.storage.delete_tree(self._name(step, directory))

    def clear_other_attempts(self, step: int, attempt: str) -> None:
        """Deletes the directories of every attempt at `step` but `attempt` (best effort: a
        writer of a dead save still running may re-create some of its objects)."""
        for other in self.attempts(step):
            if other != attempt:
                try:
                    self.storage.delete_tree(layout.attempt_dir(step, other))
                except Exception:
                    pass

    # --- markers of one save attempt ----------------------------------------------------------
    def mark_done(self, step: int, host: int, attempt: str, pieces: int, nbytes: int) -> None:
        """Host `host`'s part of save `attempt` is durable."""
        body = {
            "host": host,
            "attempt": attempt,
            "hostname": socket.gethostname(),
            "time": time.time(),
            "pieces": pieces,
            "bytes": nbytes,
        }
        self.storage.write(self._in(step, attempt, layout.done_marker(host)), json.dumps(body).encode())

    def mark_failed(self, step: int, host: int, attempt: str, error: str) -> None:
        """Host `host`'s part of save `attempt` failed: the step will never be committed."""
        body = layout.failure_body(host, attempt, error)
        self.storage.write(self._in(step, attempt, layout.failed_marker(host)), body)

    def failure(self, step: int, attempt: str) -> str | None:
        """The error of the first failure marker of save `attempt` (others' markers: ignored)."""
        directory = self._in(step, attempt, layout.FAILED_DIR)
        for name in self.storage.children(directory):
            body = layout.marker_of(self.storage, f"{directory}/{name}", attempt)
            if body is not None:
                return str(body.get("error", f"a host failed ({name})"))
        return None

    def done_hosts(self, step: int, attempt: str, hosts: list[int], known: set[int]) -> set[int]:
        """Which of `hosts` have a done marker of save `attempt` (`known` ones are not read again)."""
        directory = self._in(step, attempt, layout.DONE_DIR)
        present = set(self.storage.children(directory))
        done = set(known)
        for host in hosts:
            name = layout.done_marker(host).rsplit("/", 1)[-1]
            if host in done or name not in present:
                continue
            if layout.marker_of(self.storage, f"{directory}/{name}", attempt) is not None:
                done.add(host)
        return done

    def is_committed_by(self, step: int, attempt: str) -> bool:
        """True once save `attempt` (not an earlier save of the step) committed `step`."""
        return layout.marker_of(self.storage, self._name(step, layout.COMMITTED), attempt) is not None

    def commit(self, step: int, attempt: str, hosts: list[int]) -> bool:
        """Writes the commit marker, create-only; False when the step was committed already.
        Raises instead when the attempt's manifest is missing: a commit marker is never written
        for a step that could not be restored."""
        if self.storage.read(self._manifest(step, attempt)) is None:
            raise RuntimeError(f"the manifest of step {step} (attempt {attempt}) is missing; not committing")
        body = json.dumps({"step": step, "attempt": attempt, "time": time.time(), "hosts": hosts})
        return self.storage.write(self._name(step, layout.COMMITTED), body.encode(), create_only=True)

    def write_manifest(self, step: int, attempt: str, body: bytes) -> None:
        self.storage.write(self._manifest(step, attempt), body)

    def _name(self, step: int, entry: str) -> str:
        return f"{layout.step_dir(step)}/{entry}"

    def _in(self, step: int, attempt: str, entry: str) -> str:
        return f"{layout.attempt_dir(step, attempt)}/{entry}"

    def _manifest(self, step: int, attempt: str) -> str:
        return self._in(step, attempt, layout.MANIFEST)


def older_than(committed: list[int], step: int) -> str:
    """The hint after an error on the latest committed `step`: the step to restore instead."""
    older = [s for s in committed if s < step]
    if not older:
        return f"; step {step} is the only committed step: there is no older one to restore"
    return f"; step {step} is the latest committed step: restore(step={older[-1]}) picks an older one"
