"""Recovery after a lost host: colocar's peer snapshots vs its storage checkpoint vs Orbax.

State: 16 layers `{"w": float32[rows, 2048] sharded by rows, "b": float32[2048] replicated}` on
the 8 CPU devices of the training process (rows = 8160: 1020 MiB; `--quick`: 504, 63 MiB), split
into 4 hosts of 2 devices, one sidecar each (`local_cluster(hosts=4, processes=0)`).

Each round (default 3, `--quick` 1) runs in a process of its own (`round_main`: the state is
built there) and starts a fresh cluster, then, before the kill:

* snapshots (`Snapshots(replicas=1, pool="snap")`): a warm-up take (it opens the peer sessions),
  `takes` timed takes with an idle caller (`snapshot_blocked_s`: how long `take` held the
  caller; `snapshot_committed_s`: until the replicas were committed), and one more with the
  training loop (`ckpt.measure.step`, pure Python) running from the moment `take` returned until
  the replicas were committed: `replication_slowdown` = mean step time then / baseline - 1;
* a storage save of the state by a `CheckpointManager` on local disk, the loop running from the
  moment `save` returned until durable: `save_slowdown`; `slowdown_ratio` = replication / save
  slowdown, both floored at `SLOWDOWN_FLOOR` (the noise of this machine);
* a take's fixed cost: a 1.1 MiB state (16 x {w: f32[8, 2048], b}: 144 shards, its own
  `Snapshots`) taken 10 x `takes` times, each of new arrays (as a training step makes them)
  and committed before the next (`small_snapshot_blocked_s`), against one memcpy of it
  (`small_memcpy_state_s`);
  the goal: `small_blocked_goal_s` = 1 ms + 1.2 memcpies (`snapshot_blocked_goal_s` the same
  for the full state, from `memcpy_state_s`);
* a warm-up (untimed): a tiny tree snapshotted and checkpointed by colocar, each restored onto
  the survivors' devices (Orbax's checkpointer is warmed up the same way, once);
* Orbax's `StandardCheckpointer` (one for the run, warmed up) saves the same state to local disk;
* both save it to the GCS emulator too (fake-gcs-server, in memory, one per round: storage as a
  bucket, not a page-cached disk), colocar with an idle caller (`gcs_save_durable_s`);
* the training step (`x + 1` on every array, jitted) is compiled for the survivors' mesh (rows
  sharded over the 6 devices left), so no recovery pays XLA's compile.

Then the sidecar of one host (1, 2 or 3 by round) is SIGKILLed; `detect_s` runs from the kill until
its session is marked lost. Each recovery is timed from then until one training step on the
restored state finished (`block_until_ready`), and reported with `detect_s` added, i.e. from the
kill: `ram_s` (a: `Snapshots.latest()` + `restore` onto the 6 devices), `storage_s` (b: a
`CheckpointManager` over a `ClusterView` of the survivors, as the elastic manager reopens it,
restoring its latest step), `orbax_s` (c: Orbax restoring its save onto the 6 devices), and (b)
and (c) from the GCS emulator: `storage_gcs_s`, `orbax_gcs_s` (`gcs_speedup` = storage_gcs_s /
ram_s, `gcs_orbax_ratio` = storage_gcs_restore_s / orbax_gcs_restore_s). Their order rotates by
round. `ram_read_s`: (a) without the step (`latest` and `restore` only), and
`ram_read_memcpy_ratio` = ram_read_s / memcpy_state_s (goal <= 1.5). Every restore is checked
against the state (untimed). Both checkpoints were just written, so their files are in the page
cache (warm): a restore from a cold disk or a remote store would be slower for both. `speedup` =
storage_s / ram_s, `orbax_speedup` = orbax_s / ram_s, from the medians over rounds;
`restore_speedup` and `orbax_restore_speedup` are the same without `detect_s` (a killed local
sidecar is marked lost at the session's next heartbeat, within `heartbeat_seconds`, default 1 s; a
remote one after about three). `memcpy_s`: one `np.copyto` of a host's share of the state into a
pre-faulted buffer (`blocked_ratio` = snapshot_blocked_s / memcpy_s); `take` copies every host's
share, all from the controller, on this machine's 2 cores: `memcpy_state_s` is one thread copying
all four shares. `load_avg_1m`: the machine's load when the run ended (other tenants make the
figures scatter).

`goodput`: useful step time over wall time of a run modelled from this run's medians (the
bench's own training step is too short to stand for one): `GOODPUT_STEPS` steps of
`GOODPUT_STEP_S` s with a snapshot every `GOODPUT_EVERY`, each costing its blocked time and the
training time its replication took away (`replication_training_s` x slowdown / (1 +
slowdown)), and one loss: `ram_s` (kill to the next step) and half an interval of steps redone.

The package: `benchmark.py` runs the rounds, each in a process of its own (`round_main`),
and sums them up (`run`); `systems.py` holds the state, the snapshot's costs and the three
recoveries. `run` is imported from `benchmark.py` only when asked for.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "run":
        import importlib

        return importlib.import_module(".benchmark", __name__).run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
