"""Which layout a step is in, and every readable step of a root (controller, sidecar writer,
`colocar ckpt`; no JAX).

A manager writes one layout (`steps_of`: colocar's `step_<N>` directories, or Orbax's `<N>`)
and reads both, so a directory Orbax wrote is restored and continued by colocar, and a
directory holding both (a job moved mid-run) lists every finished step of either.
"""

from __future__ import annotations

import json
from typing import Any

from colocar.errors import CheckpointError

from ..orbax.names import ITEM
from ..orbax.steps import OrbaxSteps
from .steps import ManifestError, StepDirs, older_than
from .storage import Storage

LAYOUTS = ("colocar", "orbax")


def steps_of(storage: Storage, layout: str, item: str = ITEM) -> StepDirs:
    """The step directories a manager of `layout` writes (in Orbax's layout, into `item`)."""
    if layout == "colocar":
        return StepDirs(storage)
    if layout == "orbax":
        return OrbaxSteps(storage, item)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


class Catalog:
    """The committed steps of both layouts under one root."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.layouts = [StepDirs(storage), OrbaxSteps(storage)]

    def committed(self) -> list[int]:
        return sorted({s for steps in self.layouts for s in steps.committed()})

    def holder(self, step: int) -> StepDirs | None:
        """The layout in which `step` is committed (colocar's first, when both hold it)."""
        return next((steps for steps in self.layouts if steps.is_committed(step)), None)

    def committed_manifest(self, step: int | None) -> tuple[int, dict[str, Any], StepDirs]:
        """`step` (default: the latest committed one), its manifest and its layout; raises
        CheckpointError as `StepDirs.committed_manifest` does."""
        latest = step is None
        if step is None:
            committed = self.committed()
            if not committed:
                return self._single()
            step = committed[-1]
        steps = self.holder(step)
        if steps is None:
            raise CheckpointError(
                f"step {step} is not a committed checkpoint in {self.storage.url} "
                f"(committed: {self.committed()}){self._unfinished(step)}"
            )
        try:
            return (*steps.committed_manifest(step), steps)
        except CheckpointError as e:
            if latest:
                raise CheckpointError(f"{e}{self.older_than(step)}") from None
            raise

    def _single(self) -> tuple[Any, dict[str, Any], StepDirs]:
        """A root that is one Orbax checkpoint itself (no steps): step None."""
        orbax = self.layouts[1]
        assert isinstance(orbax, OrbaxSteps)
        item = orbax.single_item()
        if item is None:
            raise CheckpointError(f"no committed checkpoint in {self.storage.url}{self._unfinished()}")
        body = orbax.manifest_at(item, None)
        try:
            manifest = json.loads(body or b"null")
        except ValueError as e:
            raise CheckpointError(f"{self.storage.url}: its Orbax metadata is unreadable: {e}") from None
        if not isinstance(manifest, dict):
            raise CheckpointError(f"{self.storage.url}: its Orbax metadata is not a JSON object")
        return None, manifest, orbax

    def older_than(self, step: int) -> str:
        return older_than(self.committed(), step)

    def _unfinished(self, step: int | None = None) -> str:
        """Names the unfinished steps (an Orbax step without its commit), which are never read."""
        pending = sorted({s for steps in self.layouts for s in steps.all() if not steps.is_committed(s)})
        if step is not None:
            pending = [s for s in pending if s == step]
        if not pending:
            return ""
        return f"; unfinished, never restored: steps {pending}"


__all__ = ["LAYOUTS", "Catalog", "ManifestError", "steps_of"]
