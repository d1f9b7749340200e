"""The progress line of `load(..., progress=True)` (runs in the controller; rich).

It shows batches done out of the total, batches per second, the time the controller waited for
batches, the time elapsed and, when the total is known, the time left. The total is known when
`num_epochs` is a number: one sidecar counts the source's records through the pipeline's
sampler (`count_batches`), as its pump does.
"""

from __future__ import annotations

import time
from typing import Any

from colocar.controller_bridge import colocated

from .config import PipelineConfig


@colocated
def count_batches(config: PipelineConfig) -> int | None:
    """Runs on a sidecar: the pipeline's number of global batches (None: it runs forever)."""
    from colocar.loaders.worker import _record_pipeline, sampler_for

    return sampler_for(config, len(_record_pipeline(config))).num_batches


class Progress:
    """A terminal progress line for long runs: `62/120`, rate, waited, elapsed, ETA."""

    def __init__(self, total: int | None, start: int = 0, console: Any = None):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        columns: list[Any] = [
            TextColumn("input pipeline"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:.1f} batches/s, waited {task.fields[waited]:.1f} s"),
            TimeElapsedColumn(),
        ]
        if total is not None:
            columns += [TextColumn("ETA"), TimeRemainingColumn()]
        self._bar = RichProgress(*columns, console=console)
        self.total = total
        self._start = start
        self._started = time.monotonic()
        self._task = self._bar.add_task("batches", total=total, completed=start, rate=0.0, waited=0.0)
        self._bar.start()

    def advance(self, position: int, waited: float) -> None:
        rate = (position - self._start) / max(time.monotonic() - self._started, 1e-9)
        self._bar.update(self._task, completed=position, rate=rate, waited=waited)

    def stop(self) -> None:
        self._bar.stop()
