"""A real Jupyter kernel driven the way Jupyter drives it: cells run through jupyter_client,
interrupts and restarts through the kernel manager (which signals the kernel's process group).

`Kernel.run(code)` executes a cell and returns its outputs; `interrupt()` is Jupyter's ■,
`restart()` its "Restart kernel" (SIGKILL to the group, a new kernel process). The cells of
`examples/notebook.ipynb` are found by their tags.
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.manager import KernelManager

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "examples" / "notebook.ipynb"
CELL_TIMEOUT = 180.0  # a deadline, generous: a cell that starts sidecars imports JAX first


def notebook_cells(path: Path = NOTEBOOK) -> dict[str, str]:
    """The code cells of a notebook by their (first) tag."""
    notebook = nbformat.read(path, as_version=4)
    return {c.metadata["tags"][0]: c.source for c in notebook.cells if c.cell_type == "code"}


@dataclass
class Outcome:
    """What a cell printed, and how it ended (`error` is the exception's name, or "")."""

    stdout: str = ""
    stderr: str = ""
    error: str = ""
    traceback: list[str] = field(default_factory=list)

    def check(self, cell: str) -> Outcome:
        assert not self.error, f"cell {cell!r} raised {self.error}:\n" + "\n".join(self.traceback)
        return self


class Kernel:
    """An ipykernel with its manager and a blocking client; a context manager that shuts it down."""

    def __init__(self, env: dict[str, str]):
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env={**os.environ, **env})
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=CELL_TIMEOUT)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.pid  # type: ignore[union-attr]

    def start(self, code: str) -> str:
        """Starts a cell without waiting for it; returns its message id."""
        return self.client.execute(code)

    def wait(self, msg_id: str, timeout: float = CELL_TIMEOUT) -> Outcome:
        """The outputs of the cell `msg_id`, once the kernel is idle after it."""
        outcome = Outcome()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the cell did not finish within {timeout} s: {outcome}"
            try:
                message = self.client.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            self._take(message, outcome)
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                return outcome

    @staticmethod
    def _take(message: dict[str, Any], outcome: Outcome) -> None:
        kind, content = message["msg_type"], message["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                outcome.stdout += content["text"]
            else:
                outcome.stderr += content["text"]
        elif kind == "error":
            outcome.error, outcome.traceback = content["ename"], content["traceback"]

    def run(self, code: str, cell: str = "", timeout: float = CELL_TIMEOUT) -> Outcome:
        """Runs a cell; fails the test if it raised."""
        return self.wait(self.start(code), timeout).check(cell or code[:40])

    def interrupt(self) -> None:
        """Jupyter's interrupt: SIGINT to the kernel's process group (jupyter_client's killpg)."""
        self.manager.interrupt_kernel()

    def restart(self) -> None:
        """Jupyter's "Restart kernel": the old process group is killed (SIGKILL), a new kernel starts."""
        self.manager.restart_kernel(now=True)
        self.client.wait_for_ready(timeout=CELL_TIMEOUT)

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
