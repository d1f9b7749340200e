"""Modules the sidecar imports at start, before it serves (runs in the sidecar).

tensorstore's first import holds the sidecar's GIL for a second or more (nearly all of it in
ml_dtypes' extension registering its dtypes' numpy loops, C code that never lets the GIL go).
Imported on demand, by a checkpoint writer's or reader's first save or restore, that second
stalls every other thread of the sidecar: its keepalive and health replies and every call in
flight, so that a busy but healthy host looks lost. So the sidecar imports it at start, on a
thread that overlaps the rest of its start-up (the arena's pre-faulting releases the GIL), and
waits for it before its servers start: nothing that a heartbeat or a call waits on ever takes
that import. JAX and grain still come only with the shipped code
that uses them.
"""

from __future__ import annotations

import importlib
import threading

# imported before the sidecar serves: checkpoint writes and restores use it
AT_START = ("tensorstore",)


class Preload:
    """The imports of `modules`, running on a thread from construction; `wait` joins it."""

    def __init__(self, modules: tuple[str, ...] = AT_START):
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
