"""What a snapshot keeper needs around its lifetime in the sidecar: its peer link's modules
imported early, the watch that expires an idle keeper's snapshots, and the wait for dropped
blocks to be free (runs in the sidecar)."""

from __future__ import annotations

import sys
import time
import weakref


def preimport() -> None:
    """What the replication threads import, imported now: a first import there racing another
    thread's (a checkpoint writer's modules reach `colocar.controller_bridge` too) can find a
    module of that package partially initialised."""
    import colocar.controller_bridge.connection  # noqa: F401
    import colocar.controller_bridge.remote  # noqa: F401


def watch_idle(ref: weakref.ref, idle_seconds: float) -> None:
    """Runs while the keeper lives: lets it expire its snapshots once idle."""
    period = max(0.05, min(60.0, idle_seconds / 4))
    while True:
        time.sleep(period)
        keeper = ref()
        if keeper is None or keeper._closed:
            return
        if keeper.expire_if_idle():
            print(
                f"colocar snapshots: host {keeper.host} dropped its snapshots after "
                f"{keeper.idle_seconds:.0f} s without a call from their controller",
                file=sys.__stderr__,
                flush=True,
            )
        del keeper


def flush_dropped() -> None:
    """Waits until the blocks of dropped views are free (the arena's counts then say so)."""
    from colocar.shm.context import sidecar_runtime

    try:
        sidecar_runtime().flush()
    except RuntimeError:  # not in a sidecar (a unit test of the class): nothing to wait for
        pass
