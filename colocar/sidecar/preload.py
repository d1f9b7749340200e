"""Modules a sidecar imports at start, before it serves: `--preload MODULE` (runs in the sidecar).

tensorstore's first import holds the sidecar's GIL for ~0.3 s (over a second with ml_dtypes
0.7.0, whose extension registers its dtypes' numpy loops that slowly: pyproject caps it; C code
that never lets the GIL go either way), stalling every other thread of the sidecar: its
keepalive and health replies and every call in flight. A checkpoint manager therefore has it
imported on its sidecars as it is made (`checkpoint.saves.writers`), before any save or
restore. A sidecar that should never stall once it serves (one shared by several jobs) imports
it at start instead, on a thread that overlaps the rest of its start-up (the arena's
pre-faulting releases the GIL), joined before its servers start. Not by default: it costs every
sidecar start that CPU, and most never write a checkpoint (a local cluster's sidecars, a
notebook's). JAX and grain come only with the shipped code that uses them.
"""

from __future__ import annotations

import importlib
import threading

PRELOAD_HELP = (
    "import MODULE before serving (repeatable), e.g. tensorstore: its first import holds the GIL "
    "for a second, which a checkpoint manager otherwise takes as it is made"
)


class Preload:
    """The imports of `modules`, running on a thread from construction; `wait` joins it."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = modules
        self.failed: dict[str, str] = {}  # module -> why (a sidecar without it serves all else)
        self._thread = threading.Thread(target=self._run, name="colocar-preload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for name in self.modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - the use that needs it raises its own error
                self.failed[name] = f"{type(e).__name__}: {e}"

    def wait(self) -> dict[str, str]:
        """Returns once every import ended: the modules that failed to import, and why."""
        self._thread.join()
        return self.failed
