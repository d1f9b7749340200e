"""The scale-up stage: the killed host restarted and taken back into the run.

Runs in the controller. A colocar whose elastic faults offer `restart` (a sidecar started again
on its address; the manager then re-meshes onto all hosts at the next step boundary, see
docs/elastic.md "Scale back up") gets a restart fault at the demo's scale-up step; an older one
skips the stage, and the summary says so. Kept apart on purpose: the one place to change when
that API changes.
"""

from __future__ import annotations

from typing import Any

SKIPPED = "this colocar's elastic faults have no restart (scale-up arrives with it)"


def available() -> bool:
    """Whether this colocar can restart a killed host and scale the run back up."""
    from colocar.elastic import faults

    return hasattr(faults, "restart")


def fault(host: str, at_step: int | None) -> list[Any]:
    """The restart of `host` after step `at_step`, when this colocar can do it; else none."""
    if at_step is None or not available():
        return []
    from colocar.elastic import faults

    return [getattr(faults, "restart")(host, at_step=at_step)]  # noqa: B009 - not in every colocar


def result(events: list[dict[str, Any]], at_step: int | None) -> dict[str, Any]:
    """Whether the scale-up ran, from the manager's events."""
    done = [e for e in events if e["kind"] == "scale_up"]
    if done:
        return {"ran": True, "step": done[0]["step"], "seconds": round(done[0]["seconds"], 3)}
    if at_step is None:
        return {"ran": False, "reason": "no host was killed"}
    if not available():
        return {"ran": False, "reason": SKIPPED}
    return {"ran": False, "reason": f"the host restarted after step {at_step} never rejoined"}
