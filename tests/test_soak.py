"""The soak of issue 34: seeded chaos behind `--slow`, about COLOCAR_SOAK_MINUTES (default 20)
minutes on 2 cores, half single-controller, half multi-controller.

Single controller: four local sidecars, the elastic Manager's loop fed by a real loader,
snapshots every K steps and saves every M; sidecars are killed (one or two at once) and
restarted (on their address or a new port) at seeded step boundaries. Multi-controller: two
jax.distributed trainers on their own sidecars, killed (one or both), or their sidecars
replaced by empty ones, in seeded rounds; each restart resumes from RAM or storage.

Either way the training reaches its last step with the state computed from the data, bit for
bit (tests/soak_helpers.py), and the records trained on are the sampler's stream, each once,
in order; a failure loses less than one snapshot interval of steps when RAM survives, or
less than two when the newest snapshot was still replicating and the lost host's shards had
not reached a peer (counted: `in_flight`); at most two save intervals from storage (the newest
save may not have committed); nothing leaks
(processes, /dev/shm files, arena blocks). The figures go to a JSON file and are printed.
Run: `.venv/bin/python -m pytest tests/test_soak.py --slow -s` (COLOCAR_SOAK_SEED, COLOCAR_SOAK_MINUTES).
"""

from __future__ import annotations

import json
import statistics

import jax
import numpy as np
import psutil
import pytest
from elastic_helpers import Log, config, elastic_cluster, mesh_of
from helpers import wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from soak_helpers import MINUTES, SEED, Chaos, Clock, assert_exact, expected_state, losses, soak_step, summary

from colocar.checkpoint import CheckpointManager
from colocar.elastic import Manager
from colocar.loaders.sampler import IndexSampler

MiB = 1 << 20
K, M = 5, 20  # snapshot every K steps, save every M
HOSTS, MIN_HOSTS, BATCH = 4, 2, 24  # 24 records divide 8, 6 and 4 devices
STEPS_PER_MINUTE = 700  # of the single soak on the 2-core machine, chaos included (~800 quiet)
EPOCHS = 1000
step_fn = jax.jit(soak_step)


def _shardings(mesh) -> dict:
    return {
        "w": NamedSharding(mesh, P("data")),
        **{k: NamedSharding(mesh, P()) for k in ("acc", "order", "steps")},
    }


def _target(mesh) -> dict:
    want = expected_state(0, lambda k: [])
    return {
        k: jax.ShapeDtypeStruct(want[k].shape, want[k].dtype, sharding=s) for k, s in _shardings(mesh).items()
    }


class Run:
    """The single soak's record: restores (attempt, step, tier), each step's ids, timings."""

    def __init__(self, steps: int):
        sampler = IndexSampler(240, BATCH, seed=3, num_epochs=EPOCHS)
        self.batches = [sampler.batch_indices(k).tolist() for k in range(steps)]
        self.steps = steps
        self.log = Log()  # its restored and steps: the record stream the final state saw
        self.restores: list[tuple[int, int, str]] = []
        self.clock = Clock()

    def expected(self, steps: int) -> dict:
        return expected_state(steps, self.batches.__getitem__)


def _make_train(el: Manager, chaos: Chaos, run: Run, note_processes):
    """The soak's training function: every restore is checked against the data, every step's
    ids are recorded, and the chaos adds its faults before each step's `el.step`."""

    def train(hosts, devices):
        mesh = mesh_of(devices)
        state, start = el.restore(
            _target(mesh), init=lambda: jax.device_put(run.expected(0), _shardings(mesh))
        )
        run.restores.append((el.attempt, start, el.restored_from or ""))
        run.log.restored.append((el.attempt, start, {}))
        assert_exact(state, run.expected(start), f"restored step {start} from {el.restored_from}")
        it = el.load(config(global_batch_size=BATCH, num_epochs=EPOCHS), mesh)
        run.clock.restart()
        for step in range(start, run.steps):
            batch = next(it)
            state = step_fn(state, batch["index"], np.int32(step))
            run.log.steps.append((el.attempt, step, np.asarray(batch["index"]).tolist(), 0.0))
            del batch
            chaos.active = step < run.steps - 3 * M  # the last steps run calm: each kill recovers
            chaos.before_step(el, step, note_processes)
            el.step(step, {"state": state, "data": it})
            run.clock.tick(el.attempt, step)
        it.close()
        return state

    return train


def useful_seconds(restores: list[tuple[int, int, str]], clock: Clock) -> float:
    """The time of the steps the final state kept: each attempt's steps before the next restore."""
    starts = {attempt: step for attempt, step, _ in restores}
    attempts = sorted(starts)
    stop = {a: starts[b] for a, b in zip(attempts, attempts[1:], strict=False)}
    return sum(s for a, step, s in clock.steps if a not in stop or step < stop[a])


@pytest.mark.slow
@pytest.mark.timeout(int(MINUTES * 30 + 900))
def test_single_controller_soak(shm_dir, tmp_path):
    steps = max(4 * M, int(MINUTES / 2 * STEPS_PER_MINUTE))
    print(f"\n[soak single] seed {SEED}, {steps} steps, snapshot every {K}, save every {M}")
    chaos = Chaos(SEED, HOSTS, MIN_HOSTS, gap=(2 * K, 10 * K))
    run = Run(steps)
    with elastic_cluster(shm_dir, hosts=HOSTS) as (c, started):

        def note_processes() -> None:
            for process in c.processes:
                if process.poll() is None:
                    parent = psutil.Process(process.pid)
                    started.extend([parent, *parent.children(recursive=True)])

        el = Manager(
            c, CheckpointManager(str(tmp_path / "ckpt"), c, max_to_keep=3), save_every=M, snapshot_every=K
        )
        wall = run.clock.mark
        try:
            final = el.run(min_hosts=MIN_HOSTS)(_make_train(el, chaos, run, note_processes))()
            wall = run.clock.mark - wall
            assert_exact(final, run.expected(steps), "the final state")
            assert run.log.trained_on() == run.batches  # each record once, in order
            del final
        finally:
            print(f"[soak single] chaos: {chaos.actions}\n[soak single] restores: {run.restores}")
            el.close()
        alive = [h for h in c.hosts if h.connection.session.lost is None]
        for host in alive:  # the snapshots, loaders' rings and saves gave every block back
            wait_for(
                lambda host=host: _blocks(host) == 0, f"{host.name}'s arena blocks to be freed", timeout=60
            )
        note_processes()
    lost = losses(chaos.actions, run.restores)
    figures = summary(
        "single-controller",
        lost,
        wall,
        useful_seconds(run.restores, run.clock),
        steps=steps,
        restarts=sum(a["kind"] == "restart" for a in chaos.actions),
        kills=[a["hosts"] for a in chaos.actions if a["kind"] == "kill"],
        restores=len(run.restores),
    )
    check_losses(lost, K, M)
    _report(tmp_path, figures, lost)


def _blocks(host) -> int:
    return sum(pool["blocks"] for pool in host.stats()["pools"].values())


def check_losses(lost: list[dict], every: int, save_every: int) -> None:
    """Each failure recovered. From RAM: from the newest snapshot taken (less than one interval
    lost), or, when that one was still replicating and the lost host's shards had not reached
    a peer, from the one before (less than two: `in_flight`, counted in the figures); from
    storage, at most two save intervals (the newest save may still have been committing)."""
    assert lost, "the chaos fired no failure"
    for x in lost:
        assert x["restored"] is not None, x
        if x["tiers"] == ["snapshot"]:
            # the newest snapshot taken by the steps seen done (trainers may have gone further)
            newest = x["done"] // every * every
            assert x["restored"] >= newest - every, x
            x["in_flight"] = x["restored"] < newest
        else:
            assert x["lost"] <= 2 * save_every, x


def _report(tmp_path, figures: dict, lost: list[dict]) -> None:
    counts = [x["lost"] for x in lost if x["lost"] is not None]
    figures["steps_lost"] = counts
    figures["in_flight"] = sum(bool(x.get("in_flight")) for x in lost)  # the newest was replicating
    path = tmp_path / f"soak-{figures['soak']}.json"
    path.write_text(json.dumps({**figures, "failures_detail": lost}, indent=1))
    print(f"[soak {figures['soak']}] {json.dumps(figures)}\n  -> {path}")
    if counts:
        print(f"  steps lost per failure: median {statistics.median(counts)}, max {max(counts)}")


# --- multi-controller ---------------------------------------------------------------------------
MK, MM = 3, 9  # the trainers snapshot every MK steps and save every MM
ACTIONS = ("kill_both", "kill_one", "replace_one", "replace_both")
WEIGHTS = (4, 3, 3, 1)


@pytest.mark.slow
@pytest.mark.timeout(int(MINUTES * 30 + 900))
def test_multi_controller_soak(make_cluster, tmp_path, cluster, monkeypatch):
    """Seeded rounds: both trainers start, restore and run until a drawn step, then the round's
    fault: both trainers killed, one killed (the other ends by itself, or is killed too), one
    sidecar or both replaced by empty ones (the trainers end with the loss, or are killed).
    The last round runs to its stop step; its state is the data's, bit for bit."""
    import random
    import time

    from loaders_helpers import expected_labels
    from soak_helpers import Round, multi_losses
    from soak_multi import finish, play_round

    monkeypatch.setenv("COLOCAR_PROCESS_LOST_SECONDS", "3")  # a survivor ends soon (the trainers inherit it)
    rng = random.Random(SEED + 1)
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "ckpt")
    started = time.monotonic()
    rounds: list[Round] = []
    try:
        while time.monotonic() - started < MINUTES / 2 * 60:
            action = rng.choices(ACTIONS, WEIGHTS)[0]
            rounds.append(play_round(sidecars, directory, (MK, MM), action, rng.randint(2, 4 * MK), rounds))
        last = finish(sidecars, directory, (MK, MM), rounds)
        wall = time.monotonic() - started
    finally:
        cluster.make_current()
    lost = multi_losses(rounds, last)
    kept = [r.useful_s(nxt.restored) for r, nxt in zip(rounds, [*rounds[1:], last], strict=True)]
    figures = summary("multi-controller", lost, wall, sum(kept) + last.useful_s(None), rounds=len(rounds) + 1)
    figures["final_step"] = last.stop
    figures["survivor_ended_itself"] = [r.survivor_ended for r in rounds if r.action == "kill_one"]
    assert last.stop is not None
    want = expected_state(last.stop, lambda k: expected_labels(k, num_epochs=EPOCHS))
    assert last.digest == {k: want[k].tolist() for k in ("acc", "order", "steps")}, last.digest
    check_losses(lost, MK, MM)
    _report(tmp_path, figures, lost)
