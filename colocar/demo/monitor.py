"""What the demo run did, step by step: losses, step times, record ids, the manager's events.

Runs in the controller, called by `train.train` after every step. It keeps each step's
attempt, loss, duration and record ids, picks up the elastic manager's new events (snapshot,
save, fault, loss, restore, recovery, scale-up) and hands both to the display as they happen.
It also notes the kill (the first fault event) and the first step after it, for the recovery
time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class StepRecord:
    attempt: int
    step: int
    loss: float
    seconds: float
    ids: list[int]
    time: float


@dataclass
class Monitor:
    """Collects the run; `display` (optional) shows it."""

    global_batch: int
    display: Any = None
    steps: list[StepRecord] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    kill_time: float | None = None
    first_step_after_kill: float | None = None
    _seen: int = 0
    _last: tuple[int, float] | None = None  # (attempt, time) of the previous call

    def step(self, elastic: Any, step: int, loss: Any, ids: Any) -> None:
        """Step `step` of the current attempt is computed (called before `elastic.step`, which
        may end the attempt there). Its time is the span since the previous call of the same
        attempt: the whole loop, the previous step's snapshot or save included."""
        loss, ids = float(loss), np.asarray(ids).tolist()  # waits for the step
        now, attempt = time.time(), elastic.attempt
        seconds = now - self._last[1] if self._last and self._last[0] == attempt else float("nan")
        self._last = (attempt, now)
        record = StepRecord(attempt, step, loss, seconds, ids, now)
        self.steps.append(record)
        self._poll(elastic)
        if self.kill_time is not None and self.first_step_after_kill is None and attempt > 1:
            self.first_step_after_kill = now
        if self.display is not None:
            self.display.step(record, self.global_batch)

    def _poll(self, elastic: Any) -> None:
        """The manager's events since the last call (it keeps them in order)."""
        events = elastic.events.stats()["events"]
        for event in events[self._seen :]:
            if event["kind"] == "fault" and self.kill_time is None:
                self.kill_time = event["time"]
            self.events.append(event)
            if self.display is not None:
                self.display.event(event)
        self._seen = len(events)

    def finish(self, elastic: Any) -> None:
        self._poll(elastic)

    def trained_on(self) -> list[list[int]]:
        """The record ids of each step the final state was trained on: each attempt's steps
        up to the step the next attempt restored (the steps after it were replayed)."""
        out: list[list[int]] = []
        for record in self.steps:  # in order: a later attempt restarts at its restored step
            del out[record.step :]
            out.append(record.ids)
        return out

    def steps_lost(self) -> int:
        """Steps done before a loss that a later attempt did again."""
        lost, done = 0, -1
        for record in self.steps:
            if record.step <= done:
                lost += 1
            done = max(done, record.step)
        return lost
