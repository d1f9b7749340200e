"""What the soak tests (tests/test_soak.py) and their trainer program share: the exact state a
run must reach from the data alone, the seeded chaos of the single-controller soak, and the
figures (failures, recoveries, steps lost, goodput) both soaks report.

The state is integer-valued (float32 below 2**24, int32 sums that wrap the same way in numpy
and XLA), so it is bit-exact whatever the mesh, and it sums the ids of every batch trained on,
weighted by the step: a record lost, repeated or moved changes it.
"""

from __future__ import annotations

import os
import random
import re
import statistics
import time
from typing import Any

import numpy as np

SEED = int(os.environ.get("COLOCAR_SOAK_SEED", "34"))
MINUTES = float(os.environ.get("COLOCAR_SOAK_MINUTES", "20"))  # both soaks together
ROWS, COLS = 48, 16  # 48 rows divide 8, 6 and 4 devices: every mesh the single soak goes through
W0 = np.random.default_rng(34).integers(-1000, 1000, (ROWS, COLS)).astype(np.float32)


def wrap32(value: int) -> np.int32:
    """`value` modulo 2**32 as an int32: what int32 sums come to in numpy and in XLA."""
    return np.array(value % (1 << 32), np.uint32).view(np.int32)


def expected_state(steps: int, batch_ids) -> dict:
    """The state after `steps` steps whose batch k held the ids `batch_ids(k)`."""
    sums = [int(np.sum(np.asarray(batch_ids(k), np.int64))) for k in range(steps)]
    return {
        "w": W0 + np.float32(steps),
        "acc": wrap32(sum(sums)),
        "order": wrap32(sum((k + 1) * s for k, s in enumerate(sums))),
        "steps": np.int32(steps),
    }


def soak_step(state: dict, ids, step):
    """One step: w gains 1 (exact for any soak's length), acc the batch's ids, order the ids
    weighted by step + 1."""
    import jax.numpy as jnp

    total = jnp.sum(ids.astype(jnp.int32))
    return {
        "w": state["w"] + 1.0,
        "acc": state["acc"] + total,
        "order": state["order"] + (step + 1) * total,
        "steps": state["steps"] + 1,
    }


def assert_exact(got: dict, want: dict, what: str) -> None:
    for key, ref in want.items():
        value = np.asarray(got[key])
        assert value.dtype == ref.dtype and value.tobytes() == ref.tobytes(), (what, key, value, ref)


class Chaos:
    """The single-controller soak's faults, drawn from `seed`: at a step boundary where the
    manager runs on every host that is up (it recovered from the last kill, or scaled up onto
    the last host back), after a drawn number of steps, it kills one or two sidecars (SIGKILL;
    never fewer than `min_hosts` left) or restarts a dead one (on its address or a new port).
    The faults go through the manager's own schedule, so they fire after the step's snapshot."""

    def __init__(self, seed: int, hosts: int, min_hosts: int, gap: tuple[int, int]):
        self.rng = random.Random(seed)
        self.names = [f"host{i}" for i in range(hosts)]
        self.min_hosts, self.gap = min_hosts, gap
        self.down: list[str] = []
        self.actions: list[dict[str, Any]] = []  # what fired: step, kind, hosts, attempt
        self.settled_at: int | None = None
        self.wait = self.rng.randint(*gap)
        self.active = True

    def before_step(self, el, step: int, note_processes) -> None:
        """Adds the fault due after step `step` to the manager `el`'s schedule, if one is due."""
        from colocar.elastic import faults

        up = [n for n in self.names if n not in self.down]
        if not self.active or sorted(h.name for h in el.cluster.hosts) != sorted(up):
            self.settled_at = None
            return
        if self.settled_at is None:
            self.settled_at = step
        if step - self.settled_at < self.wait:
            return
        self.settled_at, self.wait = None, self.rng.randint(*self.gap)
        restart = self.down and (len(up) - 1 < self.min_hosts or self.rng.random() < 0.5)
        if restart:
            host = self.rng.choice(self.down)
            address = "127.0.0.1:0" if self.rng.random() < 0.3 else None
            self.down.remove(host)
            el.faults.add(faults.restart(host, at_step=step, address=address))
            action = {"step": step, "kind": "restart", "hosts": [host], "new_port": bool(address)}
            self.actions.append({**action, "attempt": el.attempt})
            return
        two = len(up) - 2 >= self.min_hosts and self.rng.random() < 0.25
        hosts = sorted(self.rng.sample(up, 2 if two else 1))
        note_processes()  # the sidecars' workers, which end with them
        for host in hosts:
            el.faults.add(faults.kill(host, at_step=step))
        self.down += hosts
        self.actions.append({"step": step, "kind": "kill", "hosts": hosts, "attempt": el.attempt})


def losses(actions: list[dict], restores: list[tuple[int, int, str]]) -> list[dict]:
    """Per kill: the restores that followed it (attempt, step, tier; up to the next action's
    attempt) and the steps lost: the steps done at the kill less the oldest step restored."""
    out = []
    for i, action in enumerate(actions):
        if action["kind"] != "kill":
            continue
        end = actions[i + 1]["attempt"] if i + 1 < len(actions) else None
        mine = [r for r in restores if r[0] > action["attempt"] and (end is None or r[0] <= end)]
        restored = min((step for _, step, _ in mine), default=None)
        done = action["step"] + 1
        lost = None if restored is None else max(0, done - restored)
        tiers = sorted({t for _, _, t in mine})
        out.append({**action, "done": done, "restored": restored, "tiers": tiers, "lost": lost})
    return out


def summary(kind: str, lost: list[dict], wall_s: float, useful_s: float, **extra: Any) -> dict:
    """The figures of one soak: failures, recoveries per tier, steps lost, goodput."""
    counts = [x["lost"] for x in lost if x["lost"] is not None]
    tiers: dict[str, int] = {}
    for x in lost:
        for tier in x["tiers"]:
            tiers[tier] = tiers.get(tier, 0) + 1
    return {
        "soak": kind,
        "seed": SEED,
        "failures": len(lost),
        "recoveries": tiers,
        "steps_lost_max": max(counts, default=0),
        "steps_lost_median": statistics.median(counts) if counts else 0,
        "wall_s": round(wall_s, 1),
        "useful_step_s": round(useful_s, 1),
        "goodput": round(useful_s / wall_s, 3) if wall_s else 0.0,
        **extra,
    }


class Clock:
    """Per step that ran: (attempt, step, seconds since the previous step of its attempt ended,
    or since its attempt restored)."""

    def __init__(self):
        self.mark = time.perf_counter()
        self.steps: list[tuple[int, int, float]] = []

    def restart(self) -> None:
        self.mark = time.perf_counter()

    def tick(self, attempt: int, step: int) -> None:
        now = time.perf_counter()
        self.steps.append((attempt, step, now - self.mark))
        self.mark = now


# --- the multi-controller soak's rounds ----------------------------------------------------------
class Reader:
    """Reads a trainer's output in a thread: when it restored (step, tier) and each step it did."""

    def __init__(self, process):
        import threading

        self.process = process
        self.lines: list[str] = []
        self.restored: dict | None = None
        self.steps: list[tuple[int, float]] = []  # (step, monotonic time it was printed)
        self.restored_at = 0.0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        import json

        for line in self.process.stdout:
            self.lines.append(line)
            # each report is one write, but Gloo's logging may share its line (before it)
            if step := re.search(r"\bstep (\d+)$", line.rstrip("\n")):
                self.steps.append((int(step.group(1)), time.monotonic()))
            elif restored := re.search(r"\brestored (\{.*\})$", line.rstrip("\n")):
                self.restored, self.restored_at = json.loads(restored.group(1)), time.monotonic()

    @property
    def done(self) -> int:
        return self.steps[-1][0] + 1 if self.steps else -1

    def tail(self) -> str:
        return "".join(self.lines)[-3000:]


class Round:
    """One round of the multi-controller soak: started, restored, ran, then its fault."""

    def __init__(self, action: str, readers: list[Reader], stop: int | None = None):
        self.action, self.stop = action, stop
        restored = readers[0].restored or {}
        self.restored, self.tier = restored.get("step"), restored.get("from")
        self.done = max(r.done for r in readers)  # steps done when the fault came
        self.start_at, self.steps = readers[0].restored_at, list(readers[0].steps)
        self.survivor_ended = False
        self.digest: dict = {}  # the final state's scalars, of the last round

    def useful_s(self, kept_until: int | None) -> float:
        """Seconds of this round's steps that the next round did not redo."""
        total, mark = 0.0, self.start_at
        for step, at in self.steps:
            if kept_until is None or step < kept_until:
                total += at - mark
            mark = at
        return total


def multi_losses(rounds: list[Round], last: Round) -> list[dict]:
    """Per round's fault: the steps done then, the step and tier the next round restored."""
    out = []
    for r, nxt in zip(rounds, [*rounds[1:], last], strict=True):
        lost = None if nxt.restored is None else max(0, r.done - nxt.restored)
        out.append(
            {"kind": r.action, "done": r.done, "restored": nxt.restored, "tiers": [nxt.tier], "lost": lost}
        )
    return out
