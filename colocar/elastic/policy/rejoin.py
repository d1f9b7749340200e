"""Scaling back up: lost hosts that came back rejoin the run at the next step boundary.

Runs in the controller. A host lost earlier is back when its session answers again: a stopped
sidecar resumed, or one restarted on its address (its session reconnects by itself; in a
`local_cluster`, `restart_host` connects a new session). `Manager.step` notices it after the
step's snapshot and save were started, keeps the state it was given (a `Handoff`: the arrays
as they are on the devices, and the data position) and raises `Rescale`; the run loop closes
the attempt's loaders and calls the training function again with every live host (each
returning one with a fresh session, so nothing of the old configuration stays there), and
`restore` copies the handed-over arrays onto the new mesh. No step is lost or repeated, and
nothing is read back from a snapshot or from storage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax

from colocar.controller_bridge.cluster import Cluster, Host
from colocar.errors import ColocarError
from colocar.protocol import colocar_pb2 as pb

from .events import log
from .survivors import ElasticError, alive_hosts


class Rescale(BaseException):  # noqa: N818 - a signal to the run loop, not an error
    """Raised by `Manager.step` when lost hosts came back: the run loop catches it and runs the
    training function again over all live hosts. A `BaseException`, so that a training loop's
    `except Exception` lets it through."""

    def __init__(self, hosts: list[str], step: int):
        super().__init__(f"hosts {hosts} are back: re-meshing after step {step}")
        self.hosts = hosts
        self.step = step


@dataclass
class Handoff:
    """The state at the boundary where the run scaled up, as `Manager.step` got it."""

    step: int  # steps done: the step the next attempt continues at
    tree: dict[str, Any]  # the state's parts (no data iterators)
    meta: dict[str, Any]  # keys and data position, as a snapshot or save stores them
    hosts: list[str]  # the hosts that came back
    noticed: float = field(default_factory=time.monotonic)


def returned_hosts(root: Cluster, current: Cluster) -> list[Host]:
    """The hosts of `root` alive now that the current attempt (`current`) runs without."""
    names = {h.name for h in current.hosts}
    return [h for h in alive_hosts(root) if h.name not in names]


def fresh_session(host: Host, timeout: float = 10.0) -> bool:
    """Ends `host`'s session on its sidecar and opens it anew, empty: what the old configuration
    left there is freed (a loader's workers, objects and blocks the controller gave up when the
    host was lost). A sidecar that hung for less than its session lease still holds that
    session when it answers again. False (and the host stays out) if it does not answer."""
    conn = host.connection
    conn.releases.flush(timeout)  # what the program dropped goes back under the old session
    try:
        conn.unary("Disconnect", pb.SessionRef(session_id=conn.session.session_id), timeout=10)
        conn.session.connect(timeout)
    except ColocarError as e:
        log.warning("host %s came back but did not open a fresh session: %s", host.name, e)
        return False
    return True


def reshard(tree: Any, target: Any) -> Any:
    """`tree` with each array copied onto the sharding of its leaf in `target` (a
    `jax.ShapeDtypeStruct` with a sharding, or an array), bit for bit; other leaves as they are.
    A leaf whose shape or dtype differs from the target's raises `ElasticError`."""

    def put(want: Any, have: Any) -> Any:
        sharding = getattr(want, "sharding", None)
        if sharding is None or not isinstance(have, jax.Array):
            return have
        if tuple(want.shape) != tuple(have.shape) or want.dtype != have.dtype:
            raise ElasticError(
                f"the state handed over at the scale-up has an array {have.dtype}{list(have.shape)} "
                f"where restore's target has {want.dtype}{list(want.shape)}"
            )
        return jax.device_put(have, sharding)

    return jax.tree_util.tree_map(put, target, tree)


__all__ = ["Handoff", "Rescale", "fresh_session", "reshard", "returned_hosts"]
