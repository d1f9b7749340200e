"""The pipeline of one host, living in its sidecar (`LoaderHost`, a colocated class).

Runs in the sidecar process. Its pump thread (`pump.py`) hands batch numbers to the worker
processes as ring slots come free (a bounded ring: a slow consumer stalls the workers, nothing
queues up) and gathers their reports; `next_batch()` returns, in order, an exact view of each
finished slot to the controller (over the local link), which shares the block, no copy. The
workers are stopped and the slots freed when the object goes (deleted, session ended) or on
`close()`.

A controller on the same host (it has the arena mapped) takes the batches off a **feed** instead
(`open_feed`): a Unix socket of its own (abstract namespace: no file), on which the pump sends
`(k, slot)` for each finished batch, in order, and **lends** the slot (`SlotRing.lend`): the
controller gives it back on the ring's board in the arena, and writes a byte to the socket only
while the ring waits for a slot. A batch then costs the controller one small socket message
instead of a call and a release over the local link, which matters for a training process. A
lent slot stays leased until it is given back or the socket closes (the controller is gone), so
the ring's reuse rule is that of the call path.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the pump (and the sidecar's metrics it imports) runs only on the sidecar
    from .pump import Pump

FEED_ACCEPT_TIMEOUT = 30.0


def _accept_feed(listener: socket.socket, token: bytes, pump: Pump, first: int) -> None:
    """Thread: waits for the controller on the feed socket, checks its token, hands it over."""
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
    pump.attach_feed(sock, first)


class LoaderHost:
    """One host's share of a pipeline: created on its sidecar by the controller's iterator."""

    def __init__(self, config: Any, layout: Any, start: int, host: str, starve_timeout: float = 60.0):
        import cloudpickle
        import multiprocess

        from colocar.shm.context import sidecar_runtime

        from . import worker
        from .pump import Pump
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
        self._slots = slots = [(b.offset, b.nbytes) for b in ring.blocks]
        config_bytes = cloudpickle.dumps(config)
        workers = [
            ctx.Process(
                target=worker.main,
                args=(child, (a.path, a.size, a.nonce), config_bytes, layout, slots, os.getpid()),
                daemon=True,
                name=f"colocar-pipeline-{host}-{i}",
            )
            for i, (_, child) in enumerate(pipes)
        ]
        pump = Pump(ring, workers, [parent for parent, _ in pipes], sampler.num_batches, host)
        try:
            for w in workers:
                w.start()
        except BaseException:
            pump.stop()
            raise
        finally:
            for _, child in pipes:
                child.close()
        self._pump = pump
        pump.start(start, starve_timeout)
        weakref.finalize(self, pump.stop)

    def next_batch(self) -> dict[str, Any] | None:
        """The next finished batch, in order: {"k", "slot" (an exact arena view), "bad_records"};
        None at the end. Returning the view shares the slot's block with the caller, no copy."""
        pump = self._pump
        k = self._next
        if pump.num_batches is not None and k >= pump.num_batches:
            return None
        message = pump.wait(k)
        if message is None:  # closed
            return None
        slot = pump.take(k, message)
        self._next = k + 1
        return {"k": k, "slot": pump.ring.publish(slot), "bad_records": pump.bad_records}

    def open_feed(self) -> dict[str, Any] | None:
        """A feed socket for a controller on this host (see the module docstring), or None.

        Returns where to connect (an abstract Unix socket), the token to send first, the arena's
        nonce (the controller checks it maps this arena) and the ring's slots (offset, bytes).
        The next batches go to the first controller that connects with the token; until one
        does (30 s), `next_batch` keeps working.
        """
        from colocar.shm.context import sidecar_runtime

        pump = self._pump
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"\0colocar-feed-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            listener.bind(name)
            listener.listen(1)
        except OSError:
            listener.close()
            return None
        token = secrets.token_bytes(32)
        threading.Thread(target=_accept_feed, args=(listener, token, pump, self._next), daemon=True).start()
        arena = sidecar_runtime().arena
        ring = pump.ring
        return {
            "address": name,
            "token": token,
            "nonce": arena.nonce,
            "slots": self._slots,
            "board": ring.board_block.offset,
        }

    def stats(self) -> dict[str, Any]:
        pump = self._pump
        elapsed = max(time.monotonic() - pump.started, 1e-9)
        return {
            "host": self.host,
            "batches": pump.produced,
            "batches_per_second": pump.produced / elapsed,
            "ring_slots": len(pump.ring),
            "ring_in_use": pump.ring.in_use(),
            "bad_records": pump.bad_records,
            "workers_alive": sum(w.is_alive() for w in pump.workers),
        }

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._pump.workers]

    def close(self) -> None:
        self._pump.stop()
