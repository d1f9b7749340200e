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
  plus one `syncfs(2)` of the checkpoint's filesystem right after (`_syncfs`). The sync makes
  "durable" mean the same for both (data and commit marker on disk): tensorstore fsyncs the data
  files of both, but Orbax does not fsync its metadata files nor the directory rename that
  commits a step; colocar fsyncs its markers, so for it the sync should find nothing of its own
  to write (`*_syncfs_s` shows what the sync cost; other writers on the same disk add noise).
* `restore_s`: `restore(...)` + `jax.block_until_ready`, right after the step became durable,
  so the files are in the page cache (warm).
* `train_slowdown`: the training thread runs a pure-Python step (`_step`: a fixed loop of integer
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
  full). Sampled by a separate process (`_sampler_main`, not a thread: it must not take the
  training thread's GIL) every `SAMPLE_SECONDS` (PSS from /proc/PID/smaps_rollup through psutil;
  shared-memory files are those under /dev/shm and $COLOCAR_SHM_DIR that a process of the tree
  has mapped or whose name holds one of its pids, counted by their allocated blocks while none of
  the tree maps them; mapped pages are in the PSS already). `peak_host_mem_ratio` = colocar's
  extra memory / checkpoint bytes (`orbax_peak_host_mem_ratio`: Orbax's, for comparison); the
  extra memory during restore (which includes the restored arrays) is reported as
  `*_restore_mem_mib`.
* `rpcs_per_small_save`: the calls the sidecars served (the sum of their `Stats` `calls`
  counters, read before and after) for one `save` + `wait` of a small tree (`_small`: 8 shards,
  4 per host) on 2 hosts, after a warm-up save by the same manager: the fixed per-save cost of
  talking to the writers (block allocations and object deletions are other RPCs, not counted).
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Before JAX is imported (`colocar bench` imports this module first): 8 CPU devices.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}".strip()

import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from colocar.bench import child_env  # noqa: E402

MiB = 1 << 20
LAYERS = 16
HOSTS = 2
MESH_SHAPE = (4, 2)
ARENA_MARGIN = 16 * MiB  # on top of the bytes one host writes
STEP_ITERATIONS = 20_000  # one training "step" of pure Python (~2 ms here)
BASELINE_SECONDS = 1.0  # --quick: half
SAMPLE_SECONDS = 0.02
SLOWDOWN_FLOOR = 0.02
SYSTEMS = ("colocar", "orbax")
PER_ROUND = ("blocked_s", "durable_s", "restore_s", "train_slowdown", "durable_training_s", "train_lost_s")


# --- memory: a sampler process ---------------------------------------------------------------
def _shm_dirs() -> list[str]:
    dirs = {"/dev/shm", os.environ.get("COLOCAR_SHM_DIR", "")}
    return sorted(os.path.realpath(d) for d in dirs if d and os.path.isdir(d))


def _sampler_main() -> None:
    """Runs in its own process: samples the memory of the tree under `argv[1]` (excluding
    itself) every `argv[2]` s; each line "dump" on stdin answers the samples since the last dump
    as a JSON list of [monotonic time the sample began, PSS bytes, unmapped shm bytes]; EOF
    ends it. (The time is taken before the reads: niced on busy cores, a sample can take long.)"""
    import psutil

    root, interval = psutil.Process(int(sys.argv[1])), float(sys.argv[2])
    me = os.getpid()
    os.nice(19)  # the measuring apparatus must not take CPU from either system's writers
    dirs = tuple(d + "/" for d in _shm_dirs())
    samples: list[list[float]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def tree() -> list[Any]:
        try:
            return [root] + [p for p in root.children(recursive=True) if p.pid != me]
        except psutil.NoSuchProcess:
            return []

    def loop() -> None:
        ours: set[str] = set()
        procs: list[Any] = []
        unmapped = 0
        listed = float("-inf")
        while not stop.wait(interval):
            began = time.monotonic()
            if began - listed >= 5 * interval:  # the process list and the shm files every ~100 ms
                listed = began
                procs = tree()
                if not procs:
                    stop.set()
                    return
                mapped: set[str] = set()
                for p in procs:
                    try:
                        with open(f"/proc/{p.pid}/maps") as f:
                            for line in f:  # an anonymous mapping has no 6th field (a path)
                                fields = line.split(maxsplit=5)
                                path = fields[5].strip() if len(fields) == 6 else ""
                                if path.startswith(dirs):
                                    mapped.add(path.removesuffix(" (deleted)"))
                    except OSError:
                        pass
                ours |= mapped
                pids = {f"-{p.pid}-" for p in procs}
                for d in dirs:
                    try:
                        ours |= {d + name for name in os.listdir(d) if any(s in name for s in pids)}
                    except OSError:
                        pass
                unmapped = 0
                for path in ours - mapped:
                    try:
                        unmapped += os.stat(path).st_blocks * 512
                    except OSError:
                        pass
            pss = 0
            for p in procs:
                try:
                    pss += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
            with lock:
                samples.append([began, pss, unmapped])

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    for line in sys.stdin:
        if line.strip() == "dump":
            with lock:
                out, samples[:] = list(samples), []
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
    stop.set()
    thread.join(timeout=2)


class _Memory:
    """The training process's side of the sampler: samples by time window."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from colocar.bench.ckpt import _sampler_main; _sampler_main()",
                str(os.getpid()),
                str(SAMPLE_SECONDS),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self._samples: list[list[float]] = []

    def _pull(self) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write("dump\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the memory sampler died")
        self._samples += json.loads(line)

    def baseline(self, seconds: float = 0.4) -> float:
        """Median of the total over the next `seconds` (nothing else happening), after giving
        the training process's freed heap back to the OS (else a system could reuse what an
        earlier phase freed, and look cheaper than it is)."""
        import ctypes

        gc.collect()
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
        start = time.monotonic()
        time.sleep(seconds)
        return statistics.median(self.window(start, time.monotonic(), all_=True))

    def window(self, t0: float, t1: float, all_: bool = False) -> Any:
        """The samples' totals between `t0` and `t1` (their peak unless `all_`).

        The sampler is niced, so on busy cores it can lag a whole window behind: this waits
        for its first sample begun after `t1`, which stands in for the window if none began
        inside it (a lower bound of the peak, never the 0 of an empty list)."""
        end = t1 + SAMPLE_SECONDS
        deadline = time.monotonic() + 60.0
        self._pull()
        while not self._samples or self._samples[-1][0] <= end:
            if time.monotonic() > deadline:
                raise RuntimeError("the memory sampler took no sample for 60 s")
            time.sleep(2 * SAMPLE_SECONDS)
            self._pull()
        totals = [pss + shm for t, pss, shm in self._samples if t0 <= t <= end]
        if not totals:
            totals = [next(pss + shm for t, pss, shm in self._samples if t > end)]
        self._samples = [s for s in self._samples if s[0] > end]
        return totals if all_ else max(totals)

    def close(self) -> None:
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)


# --- the training thread's work --------------------------------------------------------------
def _step() -> int:
    acc = 0
    for i in range(STEP_ITERATIONS):
        acc += i
    return acc


def _steps_for(seconds: float) -> float:
    """Mean step time (s) over `seconds` of steps."""
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        _step()
        n += 1
    return elapsed / n


def _syncfs(path: str) -> float:
    """Flushes the filesystem holding `path` (`syncfs(2)`: every dirty page and directory entry
    of it, then one disk cache flush); returns the seconds. One call whatever the number of files:
    an fsync per file costs a cache flush (~1-2 ms here) even for a clean file, which would
    charge a layout of many files for nothing."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    start = time.monotonic()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"syncfs({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)
    return time.monotonic() - start


class _System:
    """One checkpointing system as the measurement drives it; `k` names a save (1 or 2)."""

    def save(self, k: int) -> None: ...
    def wait(self) -> None: ...
    def path(self, k: int) -> str:
        raise NotImplementedError

    def restore(self, k: int) -> Any: ...
    def delete(self, k: int) -> None: ...


def _measure(
    system: _System, memory: _Memory, baseline_bytes: float, state: dict[str, Any], baseline_s: float
) -> dict[str, Any]:
    """Save 1 with an idle caller (blocked, durable, memory), its restore (checked), then save 2
    with the training loop running until durable (slowdown)."""
    import jax

    gc.collect()
    t0 = time.monotonic()
    system.save(1)
    blocked = time.monotonic() - t0
    system.wait()
    t_done = time.monotonic()
    sync_s = _syncfs(system.path(1))
    save_peak = memory.window(t0, t_done)

    t1 = time.monotonic()
    restored = system.restore(1)
    jax.block_until_ready(restored)
    restore_s = time.monotonic() - t1
    restore_peak = memory.window(t1, time.monotonic())
    _check(restored, state)
    del restored
    gc.collect()
    system.delete(1)

    step_s = _steps_for(baseline_s)
    t2 = time.monotonic()
    system.save(2)
    done = threading.Event()
    ended: list[float] = []
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            system.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            errors.append(e)
        finally:
            ended.append(time.monotonic())
            done.set()

    thread = threading.Thread(target=waiter, name="bench-ckpt-wait", daemon=True)
    thread.start()
    n, start = 0, time.perf_counter()
    while not done.is_set():
        _step()
        n += 1
    loop_s = time.perf_counter() - start
    thread.join()
    if errors:
        raise errors[0]
    durable_training = ended[0] - t2 + _syncfs(system.path(2))
    system.delete(2)
    return {
        "blocked_s": blocked,
        "durable_s": t_done - t0 + sync_s,
        "syncfs_s": sync_s,
        "restore_s": restore_s,
        "train_slowdown": (loop_s / n) / step_s - 1 if n else 0.0,
        "train_lost_s": loop_s - n * step_s,
        "durable_training_s": durable_training,
        "train_steps": n,
        "step_ms": step_s * 1e3,
        "peak_host_mem": save_peak - baseline_bytes,
        "restore_mem": restore_peak - baseline_bytes,
    }


def _check(restored: Any, state: dict[str, Any]) -> None:
    """Restored == saved, same shardings; compared on the devices (np.asarray of a sharded
    array would cache a host copy of it on the array, growing the training process)."""
    import jax
    import jax.numpy as jnp

    equal = jax.jit(lambda a, b: jnp.all(a == b))
    for key, layer in state.items():
        for name, value in layer.items():
            got = restored[key][name]
            if got.sharding != value.sharding or not bool(equal(got, value)):
                raise AssertionError(f"{key}/{name} restored wrong")


# --- the state and the two systems -----------------------------------------------------------
def _state(n: int, mesh: Any) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    w_sharding, b_sharding = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))
    rng = np.random.default_rng(0)
    state = {}
    for i in range(LAYERS):
        state[f"layer_{i:02d}"] = {
            "w": jax.device_put(rng.random((n, n), dtype=np.float32), w_sharding),
            "b": jax.device_put(rng.random((n,), dtype=np.float32), b_sharding),
        }
    return state


def _host_bytes(state: dict[str, Any], devices: list[Any]) -> list[int]:
    """The bytes each host writes (replica 0 of every shard, by the host of its device)."""
    import jax

    per_host = len(devices) // HOSTS
    host_of = {d: i // per_host for i, d in enumerate(devices)}
    out = [0] * HOSTS
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                out[host_of[shard.device]] += shard.data.nbytes
    return out


def _abstract(state: dict[str, Any]) -> Any:
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def _tiny(state: dict[str, Any]) -> dict[str, Any]:
    import jax

    b = state["layer_00"]["b"]
    return {"b": jax.device_put(np.zeros(b.shape, np.float32), b.sharding)}


def _small(state: dict[str, Any]) -> dict[str, Any]:
    """A small tree whose shards lie on both hosts: f32[64, 64] sharded like a layer's `w`."""
    import jax

    w = state["layer_00"]["w"]
    return {"w": jax.device_put(np.ones((64, 64), np.float32), w.sharding)}


def _rpcs_per_small_save(state: dict[str, Any], directory: str) -> int:
    """Calls both sidecars served for one steady-state save + wait of `_small(state)`."""
    import colocar
    from colocar.checkpoint import CheckpointManager

    devices = list(np.asarray(state["layer_00"]["w"].sharding.mesh.devices).flat)
    small = _small(state)
    with colocar.local_cluster(hosts=HOSTS, devices=devices, processes=0) as cluster:
        mngr = CheckpointManager(directory, cluster)
        try:
            mngr.save(0, small)  # warm-up: writers, lease, pool sizes
            mngr.wait()
            before = sum(h.stats()["calls"] for h in cluster.hosts)
            mngr.save(1, small)
            mngr.wait()
            return sum(h.stats()["calls"] for h in cluster.hosts) - before
        finally:
            mngr.close()


class _Colocar(_System):
    def __init__(self, mngr: Any, state: dict[str, Any]):
        self.mngr, self.state, self.target = mngr, state, _abstract(state)
        self.first: dict[str, Any] = {}  # the stats of save 1

    def save(self, k: int) -> None:
        self.mngr.save(k, self.state)

    def wait(self) -> None:
        self.mngr.wait()

    def path(self, k: int) -> str:
        return os.path.join(self.mngr.directory, f"step_{k:010d}")

    def restore(self, k: int) -> Any:
        return self.mngr.restore(k, target=self.target)

    def delete(self, k: int) -> None:
        if k == 1:
            self.first = self.mngr.stats()["save"]
        self.mngr.delete(k)


class _Orbax(_System):
    def __init__(self, ckptr: Any, directory: str, state: dict[str, Any]):
        self.ckptr, self.directory, self.state, self.target = ckptr, directory, state, _abstract(state)

    def save(self, k: int) -> None:
        self.ckptr.save(self.path(k), self.state)

    def wait(self) -> None:
        self.ckptr.wait_until_finished()

    def path(self, k: int) -> str:
        return os.path.join(self.directory, f"state_{k}")

    def restore(self, k: int) -> Any:
        return self.ckptr.restore(self.path(k), target=self.target)

    def delete(self, k: int) -> None:
        shutil.rmtree(self.path(k))


def _colocar_round(
    memory: _Memory, state: dict[str, Any], directory: str, arena: int, baseline_s: float
) -> dict[str, Any]:
    import jax

    import colocar
    from colocar.checkpoint import CheckpointManager

    baseline = memory.baseline()
    devices = list(np.asarray(state["layer_00"]["w"].sharding.mesh.devices).flat)
    with colocar.local_cluster(hosts=HOSTS, devices=devices, arena_size=arena, processes=0) as cluster:
        mngr = CheckpointManager(directory, cluster, max_to_keep=None)
        try:
            tiny = _tiny(state)
            mngr.save(0, tiny)
            mngr.wait()
            jax.block_until_ready(mngr.restore(0, target=_abstract(tiny)))
            gc.collect()
            system = _Colocar(mngr, state)
            m = _measure(system, memory, baseline, state, baseline_s)
            m["arena_wait_s"] = system.first["arena_wait_seconds"]
            m["writer_durable_s"] = system.first["durable_seconds"] or 0.0
        finally:
            mngr.close()
    return m


def _orbax_round(
    memory: _Memory, ckptr: Any, state: dict[str, Any], directory: str, baseline_s: float
) -> dict[str, Any]:
    baseline = memory.baseline()
    return _measure(_Orbax(ckptr, directory, state), memory, baseline, state, baseline_s)


def _orbax_checkpointer(state: dict[str, Any], directory: str) -> Any:
    import jax
    import orbax.checkpoint as ocp
    from absl import flags

    if not flags.FLAGS.is_parsed():  # orbax reads absl flags; a program without absl.app
        flags.FLAGS.mark_as_parsed()
    ckptr = ocp.StandardCheckpointer()
    tiny = _tiny(state)
    path = os.path.join(directory, "warmup")
    ckptr.save(path, tiny)
    ckptr.wait_until_finished()
    jax.block_until_ready(ckptr.restore(path, target=_abstract(tiny)))
    shutil.rmtree(path)
    return ckptr


def run(quick: bool, repeats: int) -> dict:
    import jax

    devices = jax.devices("cpu")
    if len(devices) != 8:
        raise RuntimeError(
            f"the ckpt benchmark needs 8 CPU devices, got {len(devices)}: set XLA_FLAGS={_DEVICES_FLAG} "
            "before JAX is imported"
        )
    rounds = min(repeats, 2) if quick else repeats
    n = 1024 if quick else 4096
    baseline_s = BASELINE_SECONDS / 2 if quick else BASELINE_SECONDS
    mesh = jax.sharding.Mesh(np.array(devices).reshape(MESH_SHAPE), ("data", "model"))
    state = _state(n, mesh)
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    arena = -(-(max(_host_bytes(state, devices)) + ARENA_MARGIN) // MiB) * MiB
    root = tempfile.mkdtemp(prefix="colocar-bench-ckpt-")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    memory = _Memory()
    try:
        ckptr = _orbax_checkpointer(state, root)
        try:
            for r in range(rounds):
                for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                    directory = os.path.join(root, f"{system}-{r}")
                    os.makedirs(directory)
                    if system == "colocar":
                        m = _colocar_round(memory, state, directory, arena, baseline_s)
                    else:
                        m = _orbax_round(memory, ckptr, state, directory, baseline_s)
                    results[system].append(m)
                    shutil.rmtree(directory)
        finally:
            ckptr.close()
        rpcs = _rpcs_per_small_save(state, os.path.join(root, "rpcs"))
    finally:
        memory.close()
        shutil.rmtree(root, ignore_errors=True)

    def med(system: str, key: str) -> float:
        return statistics.median(m[key] for m in results[system])

    out: dict[str, Any] = {
        "benchmark": "ckpt",
        "quick": quick,
        "rounds": rounds,
        "state": f"{LAYERS} x {{w: f32[{n},{n}] P(data,model), b: f32[{n}] P(model)}}, mesh (4, 2), 2 hosts",
        "checkpoint_bytes": nbytes,
        "checkpoint_mib": round(nbytes / MiB, 1),
        "arena_mib_per_host": arena // MiB,
        "rpcs_per_small_save": rpcs,
    }
    for key, scale, digits in (
        ("blocked_s", 1, 3),
        ("durable_s", 1, 3),
        ("restore_s", 1, 3),
        ("train_slowdown", 1, 3),
        ("durable_training_s", 1, 3),
        ("train_lost_s", 1, 3),
        ("syncfs_s", 1, 4),
        ("step_ms", 1, 3),
        ("peak_host_mem", MiB, 1),
        ("restore_mem", MiB, 1),
    ):
        suffix = "_mib" if scale == MiB else ""
        for system in SYSTEMS:
            out[f"{system}_{key}{suffix}"] = round(med(system, key) / scale, digits)
    for key in ("arena_wait_s", "writer_durable_s"):
        out[f"colocar_{key}"] = round(med("colocar", key), 3)
    out["blocked_ratio"] = round(med("colocar", "blocked_s") / med("orbax", "blocked_s"), 3)
    out["durable_ratio"] = round(med("colocar", "durable_s") / med("orbax", "durable_s"), 3)
    out["restore_ratio"] = round(med("colocar", "restore_s") / med("orbax", "restore_s"), 3)
    slow = {s: max(med(s, "train_slowdown"), SLOWDOWN_FLOOR) for s in SYSTEMS}
    out["train_slowdown_ratio"] = round(slow["colocar"] / slow["orbax"], 3)
    lost = {s: max(med(s, "train_lost_s"), SLOWDOWN_FLOOR * med(s, "durable_training_s")) for s in SYSTEMS}
    out["train_lost_ratio"] = round(lost["colocar"] / lost["orbax"], 3)
    out["peak_host_mem_ratio"] = round(med("colocar", "peak_host_mem") / nbytes, 3)
    out["orbax_peak_host_mem_ratio"] = round(med("orbax", "peak_host_mem") / nbytes, 3)
    for system in SYSTEMS:
        for key in PER_ROUND:
            out[f"{system}_{key}_per_round"] = [round(m[key], 3) for m in results[system]]
        mem = [round(m["peak_host_mem"] / MiB, 1) for m in results[system]]
        out[f"{system}_peak_host_mem_mib_per_round"] = mem
    return out
