"""Checkpoints: colocar's `CheckpointManager` against Orbax's async `StandardCheckpointer`.

State: 16 layers `{"w": float32[n, n], "b": float32[n]}` of random values (n = 4096: 1 GiB and
256 KiB; `--quick`: n = 1024, 64 MiB), `w` sharded `P("data", "model")` and `b` `P("model")` on a
(4, 2) mesh of the 8 CPU devices of the training process
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`); colocar splits them into 2 hosts of 4
devices (host-major, as `cluster.mesh` orders them), one sidecar each. Both systems save the same
arrays to the same local disk (a temporary directory, removed afterwards) and restore them with
the same target shardings; every restore is checked against the state (untimed).

Each round runs both systems, order alternating; figures are medians over rounds (default 5,
`--quick` 2). Per system and round:

* colocar: `local_cluster(hosts=2, processes=0, arena_size=A)` started for the round, A = the
  bytes one host writes plus `ARENA_MARGIN` (reported as `arena_mib_per_host`), then a manager
  and an untimed warm-up (a tiny step saved and restored: writer objects, lease, imports), as a
  long-running trainer would have. Orbax: one `StandardCheckpointer()` for the whole run, warmed
  up the same way once.
* `blocked_s`: how long `save(...)` held the caller.
* `durable_s`: from the `save(...)` call until `mngr.wait()` / `wait_until_finished()` returned,
  plus one `syncfs(2)` of the checkpoint's filesystem right after (`measure.syncfs`). The sync makes
  "durable" mean the same for both (data and commit marker on disk): tensorstore fsyncs the data
  files of both, but Orbax does not fsync its metadata files nor the directory rename that
  commits a step; colocar fsyncs its markers, so for it the sync should find nothing of its own
  to write (`*_syncfs_s` shows what the sync cost; other writers on the same disk add noise).
* `restore_s`: `restore(...)` + `jax.block_until_ready`, right after the step became durable,
  so the files are in the page cache (warm).
* `train_slowdown`: the training thread runs a pure-Python step (`measure.step`: a fixed loop of integer
  additions, ~2 ms here) for `BASELINE_SECONDS` (no save running: the baseline step time), then
  a second save is started and the loop runs from the moment `save(...)` returned until that
  save is durable (a second thread waits for it; its time is `durable_training_s`). The first
  save (blocked, durable, memory, then the restore) runs with an idle caller.
  slowdown = mean step time during the save / baseline step time - 1 (0:
  unaffected; 0.5: steps took 1.5x as long). `train_slowdown_ratio` = colocar / Orbax, each
  floored at `SLOWDOWN_FLOOR` (below which this machine cannot tell a slowdown from noise), so
  that a tiny or negative figure cannot blow the ratio up or make it meaningless; the raw
  figures are reported too. `train_lost_s` is the training time the save cost in all (loop
  time minus the same number of steps at the baseline time): a save that is over sooner costs
  fewer steps at the same slowdown. `train_lost_ratio` = colocar / Orbax (informative; the
  goal is on the slowdown).
* `peak_host_mem`: extra host memory = the peak, from the `save(...)` call until durable, of
  [summed PSS of the training process and all its descendants + bytes of shared-memory files of
  this process tree that no process maps] minus a baseline taken just before the system's phase
  (for colocar: before its cluster starts, so sidecars and their pre-faulted arenas count in
  full). Sampled by a separate process (`memory.sampler_main`, not a thread: it must not take the
  training thread's GIL) every `SAMPLE_SECONDS` (PSS from /proc/PID/smaps_rollup through psutil;
  shared-memory files are those under /dev/shm and $COLOCAR_SHM_DIR that a process of the tree
  has mapped or whose name holds one of its pids, counted by their allocated blocks while none of
  the tree maps them; mapped pages are in the PSS already). `peak_host_mem_ratio` = colocar's
  extra memory / checkpoint bytes (`orbax_peak_host_mem_ratio`: Orbax's, for comparison); the
  extra memory during restore (which includes the restored arrays) is reported as
  `*_restore_mem_mib`.
* `rpcs_per_small_save`: the calls the sidecars served (the sum of their `Stats` `calls`
  counters, read before and after) for one `save` + `wait` of a small tree (`systems.small`: 8 shards,
  4 per host) on 2 hosts, after a warm-up save by the same manager: the fixed per-save cost of
  talking to the writers (block allocations and object deletions are other RPCs, not counted).

The package: `benchmark.py` runs the rounds and sums them up (`run`); `measure.py` measures
one system in one round (`measure`, the training loop `step`, the restore `check`);
`memory.py` is the memory sampler (`sampler_main`, a process of its own) and `Memory`, its
training-process side; `systems.py` holds the state and the two systems (`*_round`).
`run` is imported from `benchmark.py` only when asked for: the sampler imports `memory.py`
without JAX.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "run":
        import importlib

        return importlib.import_module(".benchmark", __name__).run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
