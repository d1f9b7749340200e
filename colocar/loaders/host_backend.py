"""The pipeline of one host, living in its sidecar (`LoaderHost`, a colocated class).

Runs in the sidecar process. A scheduler thread hands batch numbers to the worker processes as
ring slots come free (a bounded ring: a slow consumer stalls the workers, nothing queues up);
a collector thread gathers their reports; `next_batch()` returns, in order, an exact view of
each finished slot to the controller (over the local link), which shares the block, no copy. The workers are
stopped and the slots freed when the object goes (deleted, session ended) or on `close()`.

A controller on the same host (it has the arena mapped) takes the batches off a **feed** instead
(`open_feed`): a Unix socket of its own (abstract namespace: no file), on which the sidecar sends
`(k, slot)` for each finished batch, in order, and **lends** the slot (`SlotRing.lend`): the
controller gives it back on the ring's board in the arena, and writes a byte to the socket only
while the ring waits for a slot. A batch then costs the controller one small socket message
instead of a call and a release over the local link, which matters for a training process. A
lent slot stays leased until it is given back or the socket closes (the controller is gone), so
the ring's reuse rule is that of the call path.
"""

from __future__ import annotations

import os
import pickle
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from typing import Any

from .worker import receive_message, send_message

# sidecar -> controller: (bytes of a pickled tail, batch number, slot, bad records so far); a
# batch has no tail (the common message, no pickling), "end" and "error" carry one.
MESSAGE = struct.Struct("<Iqiq")
FEED_ACCEPT_TIMEOUT = 30.0


class PipelineError(RuntimeError):
    """A record transform failed, a worker died, or the ring starved; names batch and host."""


class _Running:
    """The state the threads share (they must not hold the LoaderHost, so it can be collected)."""

    def __init__(self, ring: Any, workers: list, conns: list, num_batches: int | None):
        self.ring = ring
        self.workers = workers
        self.conns = conns  # one pipe per worker
        self.assigned = [0] * len(conns)  # per worker: batches sent and not reported yet
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
                slot = self.ring.acquire(timeout=starve, urgent=self.a_worker_is_idle)
            except Exception as e:  # starved, or the ring closed under us
                with self.cond:
                    self.failure = self.failure or str(e)
                    self.cond.notify_all()
                return
            if self.stopped:
                self.ring.abandon(slot)
                return
            with self.cond:  # the least busy worker: a slow one does not hold the ring up
                w = min(range(len(self.conns)), key=self.assigned.__getitem__)
                self.assigned[w] += 1
            try:
                send_message(self.conns[w], (k, slot))
            except (OSError, ValueError):  # that worker is gone; `wait` reports it
                return
            k += 1

    def a_worker_is_idle(self) -> bool:
        return min(self.assigned) == 0

    def collect(self) -> None:
        """Gathers the workers' reports (one selector for the pipeline's life, not one per wait)."""
        with selectors.DefaultSelector() as selector:
            for w, conn in enumerate(self.conns):  # by descriptor: `stop` may close the pipes
                selector.register(conn.fileno(), selectors.EVENT_READ, (w, conn))
            while not self.stopped and selector.get_map():
                for key, _ in selector.select(timeout=0.25):
                    w, conn = key.data
                    try:
                        message = receive_message(conn)
                    except (EOFError, OSError):  # a dead worker; `wait` below names it
                        selector.unregister(key.fd)
                        continue
                    with self.cond:
                        self.assigned[w] -= 1
                        self.done[message[1]] = message
                        self.cond.notify_all()
                    self.ring.nudge()  # the scheduler reads the board (slots given back silently)

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

    def feed(self, listener: socket.socket, token: bytes, start: int, host: str) -> None:
        """Serves one controller over the feed socket (thread): batches out, releases in."""
        try:
            listener.settimeout(FEED_ACCEPT_TIMEOUT)
            sock, _ = listener.accept()
        except OSError:  # nobody came: the controller uses next_batch
            return
        finally:
            listener.close()
        sock.settimeout(FEED_ACCEPT_TIMEOUT)
        try:
            got = b""
            while len(got) < len(token):
                chunk = sock.recv(len(token) - len(got))
                if not chunk:
                    break
                got += chunk
        except OSError:
            got = b""
        if not secrets.compare_digest(got, token):
            sock.close()
            return
        sock.settimeout(None)
        threading.Thread(target=self._feed_signals, args=(sock,), daemon=True).start()

        def send(k: int, slot: int = -1, tail: tuple | None = None) -> bool:
            data = b"" if tail is None else pickle.dumps(tail, protocol=pickle.HIGHEST_PROTOCOL)
            try:
                sock.sendall(MESSAGE.pack(len(data), k, slot, self.bad_records) + data)
                return True
            except OSError:
                return False

        k = start
        while True:
            if self.num_batches is not None and k >= self.num_batches:
                send(k, tail=("end",))
                return
            try:
                message = self.wait(k)
            except PipelineError as e:
                send(k, tail=("error", f"batch {k} on {host}: {e}"))
                return
            if message is None:  # closed
                send(k, tail=("end",))
                return
            if message[0] == "error":
                _, _, slot, text, tb = message
                self.ring.abandon(slot)
                send(k, tail=("error", f"batch {k} on {host}: {text}\n{tb}"))
                return
            _, _, slot, bad = message
            self.bad_records += bad
            self.produced += 1
            if not self.ring.lend(slot) or not send(k, slot):
                self.ring.return_lent()  # the controller or the pipeline is gone
                return
            k += 1

    def _feed_signals(self, sock: socket.socket) -> None:
        """Reads the board when the controller signals a slot given back; frees every lent
        slot when it goes away."""
        try:
            while sock.recv(4096):
                self.ring.reclaim_lent()
        except OSError:
            pass
        finally:
            self.ring.return_lent()
            sock.close()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for conn in self.conns:
            try:
                send_message(conn, None)
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

    def open_feed(self) -> dict[str, Any] | None:
        """A feed socket for a controller on this host (see the module docstring), or None.

        Returns where to connect (an abstract Unix socket), the token to send first, the arena's
        nonce (the controller checks it maps this arena) and the ring's slots (offset, bytes).
        The next batches go to the first controller that connects with the token; until one
        does (30 s), `next_batch` keeps working.
        """
        from colocar.shm.context import sidecar_runtime

        state = self._state
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"\0colocar-feed-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            listener.bind(name)
            listener.listen(1)
        except OSError:
            listener.close()
            return None
        token = secrets.token_bytes(32)
        threading.Thread(
            target=state.feed, args=(listener, token, self._next, self.host), daemon=True
        ).start()
        arena = sidecar_runtime().arena
        ring = state.ring
        return {
            "address": name,
            "token": token,
            "nonce": arena.nonce,
            "slots": [(b.offset, b.nbytes) for b in ring.blocks],
            "board": ring.board_block.offset,
        }

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
