"""The pipeline of one host, living in its sidecar (`LoaderHost`, a colocated class).

Runs in the sidecar process. A scheduler thread hands batch numbers to the worker processes as
ring slots come free (a bounded ring: a slow consumer stalls the workers, nothing queues up);
a collector thread gathers their reports; `next_batch()` returns, in order, an exact view of
each finished slot to the controller (over the local link), which shares the block, no copy. The workers are
stopped and the slots freed when the object goes (deleted, session ended) or on `close()`.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any


class PipelineError(RuntimeError):
    """A record transform failed, a worker died, or the ring starved; names batch and host."""


class _Running:
    """The state the threads share (they must not hold the LoaderHost, so it can be collected)."""

    def __init__(self, ring: Any, workers: list, conns: list, num_batches: int | None):
        self.ring = ring
        self.workers = workers
        self.conns = conns  # one pipe per worker: batch k goes to worker k % len
        self.num_batches = num_batches
        self.done: dict[int, tuple] = {}
        self.cond = threading.Condition()
        self.stopped = False
        self.failure: str | None = None
        self.bad_records = 0
        self.produced = 0
        self.started = time.monotonic()

    def schedule(self, start: int, starve: float) -> None:
        k = start
        while not self.stopped and (self.num_batches is None or k < self.num_batches):
            try:
                slot = self.ring.acquire(timeout=starve)
            except Exception as e:  # starved, or the ring closed under us
                with self.cond:
                    self.failure = self.failure or str(e)
                    self.cond.notify_all()
                return
            if self.stopped:
                self.ring.abandon(slot)
                return
            try:
                self.conns[k % len(self.conns)].send((k, slot))
            except (OSError, ValueError):  # that worker is gone; `wait` reports it
                return
            k += 1

    def collect(self) -> None:
        from multiprocess.connection import wait

        open_conns = list(self.conns)
        while not self.stopped and open_conns:
            for conn in wait(open_conns, timeout=0.25):
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # a dead worker; `wait` below names it
                    open_conns.remove(conn)
                    continue
                with self.cond:
                    self.done[message[1]] = message
                    self.cond.notify_all()

    def wait(self, k: int) -> tuple | None:
        """Batch k's report; None once the pipeline is stopped."""
        with self.cond:
            while k not in self.done:
                if self.stopped:
                    return None
                if self.failure:
                    raise PipelineError(self.failure)
                dead = [w for w in self.workers if not w.is_alive()]
                if dead and not self.stopped:
                    raise PipelineError(
                        f"pipeline worker process {dead[0].pid} died (exit code {dead[0].exitcode}) "
                        f"while batch {k} was being built"
                    )
                self.cond.wait(0.5)
            return self.done.pop(k)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self.workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
                w.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.ring.close()


class LoaderHost:
    """One host's share of a pipeline: created on its sidecar by the controller's iterator."""

    def __init__(self, config: Any, layout: Any, start: int, host: str, starve_timeout: float = 60.0):
        import cloudpickle
        import multiprocess

        from colocar.shm.context import sidecar_runtime

        from . import worker
        from .worker import _record_pipeline, sampler_for

        self.host = host
        self._next = start
        self.config = config
        runtime = sidecar_runtime()
        num_records = len(_record_pipeline(config))
        sampler = sampler_for(config, num_records)
        ring = runtime.ring(config.prefetch, layout.nbytes, timeout=30.0)
        ctx = multiprocess.get_context("forkserver")
        pipes = [ctx.Pipe(duplex=True) for _ in range(config.workers_per_host)]
        a = runtime.arena
        slots = [(b.offset, b.nbytes) for b in ring.blocks]
        config_bytes = cloudpickle.dumps(config)
        workers = [
            ctx.Process(
                target=worker.main,
                args=(child, (a.path, a.size, a.nonce), config_bytes, layout, slots),
                daemon=True,
                name=f"colocar-pipeline-{host}-{i}",
            )
            for i, (_, child) in enumerate(pipes)
        ]
        state = _Running(ring, workers, [parent for parent, _ in pipes], sampler.num_batches)
        try:
            for w in workers:
                w.start()
        except BaseException:
            state.stop()
            raise
        finally:
            for _, child in pipes:
                child.close()
        self._state = state
        threading.Thread(target=state.schedule, args=(start, starve_timeout), daemon=True).start()
        threading.Thread(target=state.collect, daemon=True).start()
        weakref.finalize(self, state.stop)

    def next_batch(self) -> dict[str, Any] | None:
        """The next finished batch, in order: {"k", "slot" (an exact arena view), "bad_records"};
        None at the end. Returning the view shares the slot's block with the caller, no copy."""
        state = self._state
        k = self._next
        if state.num_batches is not None and k >= state.num_batches:
            return None
        message = state.wait(k)
        if message is None:  # closed
            return None
        if message[0] == "error":
            _, _, slot, text, tb = message
            state.ring.abandon(slot)
            raise PipelineError(f"batch {k} on {self.host}: {text}\n{tb}")
        _, _, slot, bad = message
        state.bad_records += bad
        state.produced += 1
        self._next = k + 1
        return {"k": k, "slot": state.ring.publish(slot), "bad_records": state.bad_records}

    def stats(self) -> dict[str, Any]:
        state = self._state
        elapsed = max(time.monotonic() - state.started, 1e-9)
        return {
            "host": self.host,
            "batches": state.produced,
            "batches_per_second": state.produced / elapsed,
            "ring_slots": len(state.ring),
            "ring_in_use": state.ring.in_use(),
            "bad_records": state.bad_records,
            "workers_alive": sum(w.is_alive() for w in state.workers),
        }

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._state.workers]

    def close(self) -> None:
        self._state.stop()
