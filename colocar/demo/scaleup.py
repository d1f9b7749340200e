"""The scale-up stage: the killed host restarted and taken back into the run.

Runs in the controller, from the monitor at its step. It needs the elastic manager's `add_host`
and a restart fault (`colocar.elastic.faults.restart`); a colocar without them skips the stage
and the summary says so. Kept apart on purpose: this is the one place to change when that API
settles.
"""

from __future__ import annotations

import time
from typing import Any


def available(elastic: Any) -> bool:
    """Whether this colocar can restart a host and add it back to a running job."""
    from colocar.elastic import faults

    return hasattr(elastic, "add_host") and hasattr(faults, "restart")


def make(host: str) -> Any:
    """The monitor's hook: restarts `host` and adds it back; returns what happened."""

    def scale_up(elastic: Any) -> dict[str, Any]:
        if not available(elastic):
            return {"ran": False, "reason": "this colocar has no Manager.add_host / faults.restart yet"}
        from colocar.elastic import faults

        started = time.monotonic()
        getattr(faults, "restart")(elastic.root, host)  # noqa: B009 - not in every colocar yet
        elastic.add_host(host)
        return {"ran": True, "host": host, "seconds": round(time.monotonic() - started, 3)}

    return scale_up
