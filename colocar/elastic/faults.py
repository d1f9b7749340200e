"""Fault injection: kill or stop a host's sidecar, now or once training finished a step.

Runs in the controller. For tests, the demo and drills: `kill(host, at_step=s)` and
`stop(host, at_step=s)` describe a fault that the elastic manager fires from `step(s, ...)`,
after that step's snapshot or save was started; `inject(cluster, fault)` fires one now. A
killed sidecar (SIGKILL) is gone: its host is lost at the next keepalive. A stopped one
(SIGSTOP) hangs: it is lost once a keepalive goes unanswered and a new connection is not
accepted either (about five heartbeats), and
`resume` (SIGCONT; `resume_at(host, s)` after step s) lets it answer again. `restart(host,
at_step=s)` starts a dead sidecar of a `local_cluster` again, on its address or a new one.
Either way the host comes back and the elastic manager scales up onto it. `random_kill(hosts,
steps, seed)` picks the host and the step from a seed, so a drill is repeatable.
`hold_replication(cluster, host)` holds the snapshot replicas `host`'s sidecar sends until
`hold_replication(cluster, host, held=False)`: a drill loses a host while a replication is in
flight, whatever the speed of the machine. `fail_snapshot_reads(cluster, host)` makes the
snapshot reads of `host`'s sidecar raise: one process's restore fails, the others' do not.

The sidecar's process is found through `local_cluster` (its `processes`), else through the pid
the sidecar reported, when it runs on this machine; a remote sidecar cannot be reached (stop
its pod or VM instead).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any

from colocar.controller_bridge.cluster import Cluster
from colocar.controller_bridge.func import colocated

from .policy.survivors import ElasticError, host_named, loss_grace
from .snapshots.keepers import multi as multi_keeper
from .snapshots.keepers import peers

ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "resume": signal.SIGCONT}
_hold = colocated(peers.hold)
_fail_reads = colocated(multi_keeper.fail_reads)


@dataclass(frozen=True)
class Fault:
    """`action` ("kill" or "stop") on `host` (its index in the first cluster, or its name)
    once training finished step `at_step` (None: only when `inject` is called); `address`:
    where a restart starts the sidecar (None: its old address)."""

    action: str
    host: int | str
    at_step: int | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        if self.action not in ("kill", "stop", "restart", "resume"):
            raise ValueError(
                f"a fault is 'kill' or 'stop' (a loss), 'restart' or 'resume' (a return), got {self.action!r}"
            )

    @property
    def host_name(self) -> str:
        return self.host if isinstance(self.host, str) else f"host{self.host}"


def kill(host: int | str, at_step: int | None = None) -> Fault:
    """SIGKILL the sidecar of `host` once training finished step `at_step`."""
    return Fault("kill", host, at_step)


def stop(host: int | str, at_step: int | None = None) -> Fault:
    """SIGSTOP the sidecar of `host` (it hangs, as a wedged machine) after step `at_step`."""
    return Fault("stop", host, at_step)


def resume_at(host: int | str, at_step: int) -> Fault:
    """Lets the stopped sidecar of `host` run again (SIGCONT) after step `at_step`, and waits
    until its session answers: a host lost by a stop comes back (the manager scales up)."""
    return Fault("resume", host, at_step)


def restart(host: int | str, at_step: int | None = None, *, address: str | None = None) -> Fault:
    """Starts the dead sidecar of `host` again (a new session) after step `at_step`, on its
    address or on `address` (`"127.0.0.1:0"`: a free port, as a replacement machine): the
    host comes back, and the elastic manager scales back up onto it. Needs a `local_cluster`
    (`LocalCluster.restart_host`); blocks while the sidecar starts."""
    return Fault("restart", host, at_step, address)


def random_kill(hosts: int, steps: range, seed: int, *, spare: tuple[int, ...] = (0,)) -> Fault:
    """A kill of one of `hosts` hosts (never those in `spare`) at a step of `steps`, both drawn
    from `seed`: the same seed always gives the same fault."""
    rng = random.Random(seed)
    candidates = [h for h in range(hosts) if h not in spare]
    if not candidates:
        raise ValueError(f"every one of the {hosts} hosts is spared")
    return kill(rng.choice(candidates), rng.choice(list(steps)))


def _root(cluster: Cluster) -> Cluster:
    while hasattr(cluster, "parent"):
        cluster = cluster.parent
    return cluster


def _pid(cluster: Cluster, host: int | str) -> int:
    """The process id of the sidecar of `host` (by name or by its index in the first cluster)."""
    root = _root(cluster)
    name = host if isinstance(host, str) else f"host{host}"
    target = host_named(root, name)
    processes: list[Any] | None = getattr(root, "processes", None)
    if processes is not None:
        return int(processes[root.hosts.index(target)].pid)
    info = target.connection.session.info
    if info.pid and info.hostname == socket.gethostname():
        return int(info.pid)
    raise ElasticError(
        f"cannot reach the process of sidecar {target.name} at {target.address} (it runs on "
        f"{info.hostname or 'another machine'}): stop its pod or machine to drill a loss there"
    )


def signal_host(cluster: Cluster, host: int | str, action: str) -> None:
    """Sends `action`'s signal ("kill", "stop" or "resume") to the sidecar of `host`."""
    if action not in ACTIONS:
        raise ValueError(f"action is one of {sorted(ACTIONS)}, got {action!r}")
    try:
        os.kill(_pid(cluster, host), ACTIONS[action])
    except ProcessLookupError:
        pass  # already gone


def hold_replication(cluster: Cluster, host: int | str, held: bool = True) -> None:
    """Holds the snapshot replication of the sidecar of `host` (by name or by its index in the
    first cluster): its keepers send no chunk to their peers until called with `held=False`
    (a replication held when its snapshot is dropped or failed still ends)."""
    _hold.on(host_named(_root(cluster), host if isinstance(host, str) else f"host{host}"))(held)


def fail_snapshot_reads(cluster: Cluster, host: int | str, reads: tuple[str, ...] = ("blocks",)) -> None:
    """Makes the snapshot keepers of the sidecar of `host` raise on `reads` until called with
    `reads=()`: "blocks" (a slice of their shards: a restore's read), "holdings" (what they
    hold: a survey's read). A drill fails one process's snapshot read, not the others'."""
    target = host_named(_root(cluster), host if isinstance(host, str) else f"host{host}")
    _fail_reads.on(target)(list(reads))


def inject(cluster: Cluster, fault: Fault) -> None:
    """Fires `fault` now, whatever its step."""
    if fault.action == "resume":
        resume(cluster, fault.host_name)
        return
    if fault.action != "restart":
        signal_host(cluster, fault.host_name, fault.action)
        return
    root = _root(cluster)
    restart_host = getattr(root, "restart_host", None)
    if restart_host is None:
        raise ElasticError(
            f"cannot restart sidecar {fault.host_name}: only a local_cluster starts its sidecars; "
            "restart it where it runs (its session reconnects by itself)"
        )
    restart_host(fault.host_name, address=fault.address)


def resume(cluster: Cluster, host: int | str, timeout: float | None = None) -> None:
    """Lets a stopped sidecar run again (SIGCONT) and waits until its session answers (it
    reconnects at its next heartbeat if it was marked lost), at most `timeout` seconds
    (default: `policy.survivors.loss_grace`); raises `ElasticError` if it does not."""
    signal_host(cluster, host, "resume")
    target = host_named(_root(cluster), host if isinstance(host, str) else f"host{host}")
    deadline = time.monotonic() + (loss_grace(cluster) if timeout is None else timeout)
    while target.connection.session.lost is not None:
        if time.monotonic() > deadline:
            raise ElasticError(
                f"sidecar {target.name} at {target.address} did not answer again after SIGCONT"
            )
        time.sleep(0.05)


class Schedule:
    """Faults waiting for their step; each fires once."""

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = ()):
        self.pending = list(faults)
        self.fired: list[tuple[int, Fault]] = []

    def add(self, fault: Fault) -> None:
        if fault.at_step is None:
            raise ValueError("a scheduled fault needs at_step; call inject(cluster, fault) to fire it now")
        self.pending.append(fault)

    def fire_due(self, cluster: Cluster, step: int) -> list[Fault]:
        """Fires (and forgets) the faults due at `step`; returns them."""
        due = [f for f in self.pending if f.at_step == step]
        for fault in due:
            self.pending.remove(fault)
            inject(cluster, fault)
            self.fired.append((step, fault))
        return due
