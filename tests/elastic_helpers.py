"""What the elastic tests share: a range pipeline whose records carry their ids, a tiny linear
model trained with momentum SGD (deterministic on CPU), and an uninterrupted reference run.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from elastic_records import DIM, B, MiB, N, config, features
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def mesh_of(devices) -> Mesh:
    return Mesh(np.array(devices), ("data",))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def init(mesh: Mesh):
    zeros = {"params": {"w": np.zeros(DIM, np.float32), "b": np.zeros((), np.float32)}}
    zeros["mom"] = {"w": np.zeros(DIM, np.float32), "b": np.zeros((), np.float32)}
    return jax.device_put(zeros, replicated(mesh))


def abstract(mesh: Mesh):
    def spec(shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=replicated(mesh))

    return {"params": {"w": spec((DIM,)), "b": spec(())}, "mom": {"w": spec((DIM,)), "b": spec(())}}


@jax.jit
def train_step(state, batch):
    def loss_fn(p):
        pred = batch["x"] @ p["w"] + p["b"]
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    mom = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, state["mom"], grads)
    params = jax.tree_util.tree_map(lambda p, m: p - 0.05 * m, state["params"], mom)
    return {"params": params, "mom": mom}, loss


def to_numpy(state):
    return jax.tree_util.tree_map(lambda a: np.array(a), state)


def assert_bitwise(a, b) -> None:
    leaves_a, tree_a = jax.tree_util.tree_flatten(to_numpy(a))
    leaves_b, tree_b = jax.tree_util.tree_flatten(to_numpy(b))
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes(), (x, y)


def local_batch(k: int, mesh: Mesh, batch_size: int = B) -> dict:
    """Global batch k built here from the sampler and `features`, without the loader: the
    reference the loader's batches must equal."""
    from colocar.loaders.sampler import IndexSampler

    ids = IndexSampler(N, batch_size, seed=3).batch_indices(k)
    rows = [features({"index": i}) for i in ids]
    sharding = NamedSharding(mesh, P("data"))
    return {name: jax.device_put(np.stack([r[name] for r in rows]), sharding) for name in rows[0]}


def plain_run(devices, state, start: int, stop: int, batch_size: int = B):
    """Steps start..stop-1 on `devices` without the elastic manager nor the loader: (states
    after each step, ids, losses)."""
    mesh = mesh_of(devices)
    states, ids, losses = {start: to_numpy(state)}, [], []
    for step in range(start, stop):
        batch = local_batch(step, mesh, batch_size)
        ids.append(np.asarray(batch["index"]).tolist())
        state, loss = train_step(state, batch)
        losses.append(float(loss))
        states[step + 1] = to_numpy(state)
    return states, ids, losses


def sidecar_descendants(cluster, depth: int = 1) -> list:
    """The processes the sidecars of a local cluster started, `depth` or more levels down
    (1: all; 2: the pipeline workers, which their process server forks)."""
    import psutil

    level = [psutil.Process(p.pid) for p in cluster.processes if p.poll() is None]  # not a dead sidecar
    for _ in range(1, depth):
        level = [c for p in level for c in p.children()]
    return [q for p in level for q in p.children(recursive=True)]


class Log:
    """What an elastic run did: per attempt, the step it restored, and each step's ids and loss."""

    def __init__(self):
        self.restored: list[tuple[int, int, dict]] = []  # (attempt, step, state as numpy)
        self.steps: list[tuple[int, int, list[int], float]] = []  # (attempt, step, ids, loss)
        self.processes: list = []  # what the sidecars ran while the first loader was open
        self.workers: list = []  # of which the pipeline workers
        self.states: dict[tuple[int, int], dict] = {}  # (attempt, steps done) -> state as numpy
        self.attempt_workers: dict[int, list] = {}  # attempt -> its pipeline workers
        self.times: list[tuple[int, int, float]] = []  # (attempt, step, perf_counter at its end)
        self.waits: list[tuple[int, float]] = []  # (attempt, seconds next(it) blocked)
        self.loaders: list = []  # every attempt's loader, held as a user's code might: only an
        # explicit close (by the manager, after a loss or at a scale-up) ends their workers

    def saved_state(self, attempt: int, step: int, reference: dict) -> dict:
        """The state after `step` steps that attempt `attempt` restored: the one of the attempt
        that last ran that step before it (the first attempt is the uninterrupted run)."""
        earlier = [a for a, s in self.states if a < attempt and s == step]
        return self.states[(max(earlier), step)] if earlier and max(earlier) > 1 else reference[step]

    def trained_on(self) -> list[list[int]]:
        """The batches (ids) the final state was trained on: each attempt's steps from the step
        it restored up to the step the next attempt restored."""
        out: list[list[int]] = []
        bounds = [step for _, step, _ in self.restored] + [None]
        for (attempt, start, _), stop in zip(self.restored, bounds[1:], strict=True):
            out = out[:start]
            assert len(out) == start, f"attempt {attempt} restored step {start} after {len(out)} steps"
            out += [ids for a, s, ids, _ in self.steps if a == attempt and (stop is None or s < stop)]
        return out


def make_train(el, log: Log, steps: int | None, cfg=None):
    """The elastic training function of the tests: `steps` steps (None: until the data ends),
    with the pipeline `cfg(devices)` (default: the fixed global batch)."""
    import itertools
    import time

    def train(hosts, devices):
        mesh = mesh_of(devices)
        state, start = el.restore(abstract(mesh), init=lambda: init(mesh))
        log.restored.append((el.attempt, start, to_numpy(state)))
        # no `with`: after a loss the manager closes the loader (the tests check its workers end)
        it = el.load(cfg(devices) if cfg else config(), mesh)
        log.loaders.append(it)
        for step in range(start, steps) if steps is not None else itertools.count(start):
            waited = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            log.waits.append((el.attempt, time.perf_counter() - waited))
            ids = np.asarray(batch["index"]).tolist()
            if not log.processes:
                log.processes = sidecar_descendants(el.root)
                log.workers = sidecar_descendants(el.root, depth=2)
            if el.attempt not in log.attempt_workers:
                log.attempt_workers[el.attempt] = sidecar_descendants(el.root, depth=2)
            state, loss = train_step(state, batch)
            del batch
            log.steps.append((el.attempt, step, ids, float(loss)))
            log.states[(el.attempt, step + 1)] = to_numpy(state)
            log.times.append((el.attempt, step, time.perf_counter()))
            el.step(step, {"state": state, "data": it})
        it.close()
        return state

    return train


@contextlib.contextmanager
def elastic_cluster(shm_dir: str, hosts: int = 3, lease_seconds: float = 2):
    """`hosts` sidecars with two devices each, restartable (`restart_host`). Afterwards every
    process they started, restarted sidecars and their workers included, is gone, and so are
    their arena files."""
    import os

    import psutil
    from helpers import kill_if_stopped

    import colocar

    before = set(os.listdir(shm_dir))
    c = colocar.local_cluster(
        hosts=hosts,
        devices=jax.devices()[: 2 * hosts],
        arena_size=16 * MiB,
        lease_seconds=lease_seconds,
        heartbeat_seconds=0.5,
        processes=0,
    )
    started: list = []

    def note_processes() -> None:
        for process in c.processes:
            if process.poll() is None:
                parent = psutil.Process(process.pid)
                started.extend([parent, *parent.children(recursive=True)])

    note_processes()
    try:
        yield c, started
    finally:
        note_processes()  # the sidecars restarted meanwhile
        for process in c.processes:
            kill_if_stopped(process)
        c.close()
    alive = psutil.wait_procs(started, timeout=30)[1]
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    assert set(os.listdir(shm_dir)) <= before
