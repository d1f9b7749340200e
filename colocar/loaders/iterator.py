"""The controller's iterator of global batches (runs in the controller / device owner).

It ships the pipeline once (a `LoaderHost` on each host's sidecar), then, per step, takes each
host's finished slot (an arena view: a descriptor over the local link, no bytes), puts every
device's segment on its device (aliased on CPU, so the slot stays leased while the batch's
arrays live) and assembles global `jax.Array`s. The workers run up to `prefetch` batches ahead
in the ring, so the next batch is usually ready. Its state is the number of the next global
batch: JSON-able, and exact on any number of hosts for index-based sources. Under
multi-controller JAX each process drives only the hosts of its own devices of the global mesh
(`plan`), and the processes check that they agree on the pipeline and the state (`agreement`).

Slots come back one way, by reachability: a batch's views of its slot all derive from one
array, the batch's anchor, and the slot is queued once the anchor is unreachable (a weakref,
see `feed`; over calls, the slot's block lease goes the same way with the block's holder,
`shm.views`). JAX on CPU keeps the views it aliased until its deferred releases run, so each
step (and `release`, `close`) first runs them (`jax_compat.release_deferred`), then lets each
feed send the slots that came free. No reference counts are compared.

An interrupted `next()` (Ctrl-C) returns nothing and loses nothing: a feed takes a batch's
header whole or not at all, and when some hosts had already handed the batch over (or a host
is reached by calls, whose interrupted reply is dropped), the next `next()` starts the hosts'
pipelines again at the same batch, so the stream of batches stays exact.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from colocar import jax_compat
from colocar.controller_bridge import colocated, colocated_class
from colocar.controller_bridge.cluster import Cluster

from .agreement import Agreement, identity
from .config import PipelineConfig, load_config
from .feed import Feed
from .host_backend import LoaderHost
from .orders import STATE_KEY, saved_order
from .plan import HostPlan, check_batch_axes, host_plans, local_groups, pipelines_gone
from .progress import Progress, count_batches
from .puts import batched_put_order, batched_puts
from .start import open_hosts

STATE_VERSION = 1


RemoteLoaderHost = colocated_class(LoaderHost)


@colocated
def _probe_fields(config: PipelineConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Runs on a sidecar: the fields of the first record the pipeline keeps."""
    from colocar.loaders.errors import PipelineError
    from colocar.loaders.worker import _record_pipeline, check_dict

    pipeline = _record_pipeline(config)
    for index in range(min(len(pipeline), 1000)):
        record = pipeline[index]
        if record is not None:
            try:
                check_dict(record, index, pipeline)
            except TypeError as e:
                raise PipelineError(f"probing the fields (no element_spec): {e}") from None
            return {name: (np.shape(v), np.asarray(v).dtype.name) for name, v in record.items()}
    raise ValueError("none of the first 1000 records passes the pipeline's filters")


def _progress(config: PipelineConfig, host: Any, start: int) -> Progress:
    """The progress line, with the total (counted on `host`) when `num_epochs` bounds it."""
    total = None if config.num_epochs is None else count_batches.on(host)(config)
    return Progress(total, start)


def _needs_mask(config: PipelineConfig) -> bool:
    return config.eval or config.skip_bad_records or any(t.kind == "filter" for t in config.transforms)


class DataIterator:
    """Global batches (dicts of `jax.Array`s, batch axis sharded) from a pipeline config."""

    def __init__(
        self,
        config: PipelineConfig,
        cluster: Cluster,
        mesh: jax.sharding.Mesh,
        start: int = 0,
        starve_timeout: float = 60.0,
        progress: bool = False,
        sync_timeout: float = 300.0,
    ):
        self.config = config
        self.starve_timeout = starve_timeout
        axes = config.batch_axes or tuple(mesh.axis_names)
        B = config.global_batch_size
        check_batch_axes(mesh, axes, B)
        groups = local_groups(cluster, mesh)  # this process's hosts and their devices of the mesh
        if config.element_spec:
            fields = {name: (tuple(f.shape), f.dtype) for name, f in config.element_spec.items()}
        else:
            fields = _probe_fields.on(groups[0][0])(config)
        if _needs_mask(config):
            fields["mask"] = ((), "bool")
        self.fields = fields
        self.shardings = {
            name: NamedSharding(mesh, P(axes, *([None] * len(shape)))) for name, (shape, _) in fields.items()
        }
        self._plan: list[HostPlan] = host_plans(groups, NamedSharding(mesh, P(axes)), B, fields)
        processes = sorted({d.process_index for d in mesh.devices.flat})
        if jax.process_count() > 1 and len(processes) == 1:
            warnings.warn(
                f"the mesh has only JAX process {processes[0]}'s devices: this iterator loads whole "
                "global batches, the same records as the same pipeline in every other process; pass "
                "the global mesh (all processes' devices) to split each batch across processes",
                stacklevel=3,
            )
        self._agreement = Agreement(processes, jax.process_index(), sync_timeout)
        self._agreement.check("load", identity(config, mesh, axes, start))
        self._targets = [device for _, _, placed in self._plan for device, _ in placed]
        self._put_order = batched_put_order(fields, self.shardings, self._targets)
        self._puts = batched_puts(self._put_order, fields, self.shardings, self._targets, B)
        self._release_deferred = jax_compat.release_deferred()
        self.wait_seconds = 0.0
        self.batches = 0
        self._progress: Progress | None = None
        self._remote: list[Any] = []
        self._feeds: list[Feed | None] = []
        self._fed: list[Feed] = []
        self._out_of_step = False  # an interrupted next() left some hosts a batch ahead
        self._open(start)
        if progress:
            try:
                self._progress = _progress(config, groups[0][0], start)
            except BaseException:
                self.close()
                raise

    def _open(self, start: int) -> None:
        """The hosts' pipelines, from batch `start` on (an interrupt leaves none open)."""
        self._remote, self._feeds = open_hosts(
            RemoteLoaderHost.on, self._plan, self.config, start, self.starve_timeout
        )
        self._fed = [feed for feed in self._feeds if feed is not None]
        for feed in self._fed:  # a wait for one host's batch frees the dropped batches' slots
            feed.waiting = self._free_dropped_slots
        self._generations = [host.connection.session.generation for host, _, _ in self._plan]
        self.position = start
        self._out_of_step = False

    def __iter__(self) -> DataIterator:
        return self

    def _free_dropped_slots(self) -> None:
        """Gives back the slots of batches the program dropped.

        JAX on CPU aliases a slot's memory in `device_put` and holds the numpy views until the
        buffers go; it drops those references only in its deferred releases. Running them now
        lets the views of dropped batches die, whose anchors queue their slots (`feed`); then
        each feed sends its queued slots back.
        """
        self._release_deferred()
        for feed in self._fed:
            feed.poll()

    def _gather(self, k: int) -> dict[str, list[np.ndarray]] | None:
        """Per field, every host's views of batch `k` (plan order); None at the end of the data.

        The feeds' views are made once every host delivered, one after another: after a wait
        for data only the first pays for cold caches. A slot received but not viewed (an error,
        the end of the data) goes straight back, and nothing here keeps views once it raised
        (a failure keeps this frame in its traceback)."""
        ended = False
        parts: list[tuple[Feed, int] | dict[str, list[np.ndarray]]] = []  # per host, plan order
        pieces: dict[str, list[np.ndarray]] | None = None  # the first host's views, then all
        try:
            for obj, feed, (_, layout, placed) in zip(self._remote, self._feeds, self._plan, strict=True):
                if feed is not None:
                    lent = feed.receive(k)
                    if lent is None:
                        ended = True
                    else:
                        parts.append((feed, lent))
                    continue
                item = obj.next_batch()
                if item is None:
                    ended = True
                elif item["k"] != k:
                    raise RuntimeError(f"{obj} returned batch {item['k']}, expected {k}")
                else:
                    parts.append(layout.slot_views(item["slot"], [s for _, s in placed]))
                item = None
            if ended:
                return None
            for i, part in enumerate(parts):
                if isinstance(part, tuple):
                    parts[i] = part = part[0].views(part[1])
                if pieces is None:
                    pieces = part  # fresh lists: the first host's become the batch's
                else:
                    for name, field_views in part.items():
                        pieces[name] += field_views
            return pieces
        except BaseException as e:
            for part in parts:  # drop the views made so far now, not with the traceback
                if isinstance(part, dict):
                    part.clear()
            if not isinstance(e, Exception):  # an interrupt: hosts that handed batch k over are ahead
                self._out_of_step = bool(parts) or None in self._feeds
            raise
        finally:
            for part in parts:
                if isinstance(part, tuple):
                    part[0].give_back(part[1])
            parts.clear()

    def __next__(self) -> dict[str, jax.Array]:
        if self._out_of_step:  # an interrupted next(): start the pipelines again at this batch
            self._close_remote()
            self._open(self.position)
        self._free_dropped_slots()
        started = time.perf_counter()
        k = self.position
        try:
            pieces = self._gather(k)
        except Exception as e:
            gone = pipelines_gone(self._plan, self._generations)
            if gone is not None:  # not the pipeline's fault: say so, and how to go on
                raise gone from e
            raise
        if pieces is None:
            raise StopIteration
        self.wait_seconds += time.perf_counter() - started
        batch: dict[str, jax.Array] = {}
        if self._put_order is not None:
            # One batched put per field builds the global array from its per-device views
            # (aliased on CPU, as with device_put): ~10x less CPU than device_put of each view
            # and make_array_from_single_device_arrays.
            put = self._put_order[1].put
            for name, aval, sharding, order, devices in self._puts:
                views = pieces[name]
                if order is not None:
                    views = [views[i] for i in order]
                batch[name] = put(aval, sharding, views, devices)
        else:
            B = self.config.global_batch_size
            targets = self._targets
            names = list(self.fields)
            arrays = jax.device_put([v for name in names for v in pieces[name]], targets * len(names))
            n = len(targets)
            for f, (name, (shape, _)) in enumerate(self.fields.items()):
                mine = arrays[f * n : (f + 1) * n]
                sharding = self.shardings[name]
                batch[name] = jax.make_array_from_single_device_arrays((B, *shape), sharding, mine)
        self.position += 1
        self.batches += 1
        if self._progress is not None:
            self._progress.advance(self.position, self.wait_seconds)
        return batch

    def release(self, batch: dict[str, jax.Array]) -> None:
        """Gives a batch back now, instead of when the program drops its last reference.

        Deletes the batch's arrays (reading one afterwards raises "Array has been deleted")
        and returns the slots nothing else reads any more at once, without waiting for Python's
        garbage collector: useful when a reference to the batch lingers (a loop variable, a
        logged dict) while the ring needs its slots. The rule that frees a slot is unchanged:
        anything still built on its memory (a numpy view from `np.asarray`, a computation in
        flight) keeps it until that goes too, so a released batch never yields wrong values.
        Dropping the batch (the default) gives it back as well; `release` is only sooner.
        """
        for array in batch.values():
            if isinstance(array, jax.Array):
                array.delete()
        self._free_dropped_slots()  # JAX's deferred releases of the deleted buffers' views first

    def get_state(self) -> dict[str, Any]:
        """JSON-able position: resuming from it yields exactly the batches that would come next.

        With a mesh over several JAX processes, every process must call it at the same batch:
        it checks that they all hold the same state (`ProcessesDisagree` otherwise)."""
        c = self.config
        state = {
            "version": STATE_VERSION,
            "next_batch": self.position,
            "global_batch_size": c.global_batch_size,
            "seed": c.seed,
            "shuffle": c.shuffle,
            STATE_KEY: c.shuffle_order,
        }
        self._agreement.check("get_state", state)
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        c = self.config
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"iterator state version {state.get('version')!r}, expected {STATE_VERSION}")
        saved = {**state, STATE_KEY: saved_order(state)}  # states before the key: colocar's order
        for key in ("global_batch_size", "seed", "shuffle", STATE_KEY):
            if saved[key] != getattr(c, key):
                raise ValueError(
                    f"iterator state was saved with {key}={saved[key]!r} but the pipeline has "
                    f"{getattr(c, key)!r}: batches would not continue the saved sequence"
                )
        self._agreement.check("set_state", {"next_batch": int(state["next_batch"])})
        self._close_remote()
        self._open(int(state["next_batch"]))

    def stats(self) -> dict[str, Any]:
        """Per-host throughput and ring occupancy, and how long the controller waited for data."""
        return {
            "batches": self.batches,
            "controller_wait_seconds": self.wait_seconds,
            "hosts": [obj.stats() for obj in self._remote],
        }

    def _close_remote(self) -> None:
        release = getattr(self, "_release_deferred", None)
        if release is not None:
            release()  # so that each feed's close() first sends the slots already free
        for feed in getattr(self, "_fed", ()):
            feed.close()
        self._feeds, self._fed = [], []
        closing = []
        for obj in self._remote:  # every host at once: each joins its workers (~0.4 s)
            try:
                closing.append(obj.close.submit())
            except Exception:  # a lost host: its session's lease frees everything
                pass
        for future in closing:
            try:
                future.result()
            except Exception:
                pass
        self._remote = []

    def close(self) -> None:
        """Stops every host's workers and frees their slots (held batches stay valid)."""
        self._close_remote()
        self._free_dropped_slots()
        if self._progress is not None:
            self._progress.stop()

    def __enter__(self) -> DataIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing():  # no call can end now; the session's end frees the workers
            return
        try:
            self._close_remote()
        except Exception:
            pass


def load(
    config: Any,
    cluster: Cluster,
    mesh: jax.sharding.Mesh | None = None,
    *,
    start: int = 0,
    starve_timeout: float = 60.0,
    progress: bool = False,
    sync_timeout: float = 300.0,
) -> DataIterator:
    """An iterator of global batches for `config` (a file path, dict or PipelineConfig).

    `mesh` defaults to `cluster.mesh(("data",))`, with several JAX processes to one "data" axis
    over `jax.devices()`; the batch axis is sharded over
    `config.batch_axes` (default: all mesh axes). If the program holds on to every batch of a
    host's ring for `starve_timeout` seconds, iterating raises instead of waiting forever.
    `progress=True` shows a progress line (rich) for long runs.

    Multi-controller JAX (one process per host, each connected to its own sidecar): pass the
    global mesh in every process; each one feeds only its devices' rows of each global batch,
    from its own sidecar, and the global batch is the one a single controller would load. The
    processes check through jax.distributed that they load the same config from the same
    batch, here and at `get_state`/`set_state`, waiting at most `sync_timeout` s for each other.
    """
    if mesh is None:  # with several JAX processes, their devices together (host-major)
        several = jax.process_count() > 1
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",)) if several else cluster.mesh(("data",))
    return DataIterator(load_config(config), cluster, mesh, start, starve_timeout, progress, sync_timeout)
