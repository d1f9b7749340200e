"""Block allocator over the arena's data region, with pools and leases (sidecar process only).

The data region is split into named pools with disjoint, reserved regions so one
workload (say, checkpoint staging) can never starve another (say, input batches).
Each pool is a first-fit allocator over a sorted free list with coalescing. A block
lives while some owner (a controller session, a worker, the sidecar itself) holds a
lease on it; the last release frees it and wakes allocations waiting for room.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

SMALL_ALIGN = 64
LARGE_ALIGN = 4096
LARGE_THRESHOLD = 64 * 1024
DEFAULT_POOL = "default"
ENDED_KEPT = 65536  # ended owners remembered: a call can finish long after its session closed


class ArenaFullError(MemoryError):
    """No room in the pool for the request, even after waiting."""


class OwnerEndedError(RuntimeError):
    """The owner ended (a closed session): it can hold no block any more."""


class UnknownBlockError(KeyError):
    """The block id is not live, or not leased by that owner."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Block:
    """An allocated extent; ``offset`` is absolute in the arena file (>= HEADER_BYTES)."""

    id: int
    offset: int
    nbytes: int
    pool: str


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def footprint(nbytes: int) -> int:
    """The bytes of its pool a block of ``nbytes`` takes (alignment included)."""
    return _footprint(nbytes)[1]


def _footprint(nbytes: int) -> tuple[int, int]:
    """(alignment, bytes taken) for a request: sizes round up to the alignment, 0 takes one unit."""
    align = LARGE_ALIGN if nbytes >= LARGE_THRESHOLD else SMALL_ALIGN
    return align, max(align, _align_up(nbytes, align))


class _Pool:
    """One pool's region and sorted free list of (offset, size) extents."""

    def __init__(self, name: str, start: int, size: int, lock: threading.Lock) -> None:
        self.name = name
        self.start = start
        self.size = size
        self.free: list[tuple[int, int]] = [(start, size)] if size > 0 else []
        self.used = 0
        self.peak = 0
        self.blocks = 0
        self.allocated = 0  # bytes of every block ever carved: what moved through the pool
        self.cond = threading.Condition(lock)

    def largest_free(self) -> int:
        return max((size for _, size in self.free), default=0)

    def take(self, align: int, nbytes: int) -> int | None:
        """First fit: carve ``nbytes`` at an ``align``-ed offset; None if nothing fits."""
        for i, (off, size) in enumerate(self.free):
            start = _align_up(off, align)
            end = off + size
            if start + nbytes > end:
                continue
            pieces = []
            if start > off:
                pieces.append((off, start - off))
            if start + nbytes < end:
                pieces.append((start + nbytes, end - start - nbytes))
            self.free[i : i + 1] = pieces
            self.used += nbytes
            self.allocated += nbytes
            self.peak = max(self.peak, self.used)
            self.blocks += 1
            return start
        return None

    def give_back(self, offset: int, nbytes: int) -> None:
        """Return an extent to the free list, merging it with free neighbours."""
        i = bisect.bisect_left(self.free, (offset, 0))
        end = offset + nbytes
        if i < len(self.free) and self.free[i][0] == end:
            end += self.free[i][1]
            del self.free[i]
        if i > 0 and sum(self.free[i - 1]) == offset:
            offset = self.free[i - 1][0]
            i -= 1
            del self.free[i]
        self.free.insert(i, (offset, end - offset))
        self.used -= nbytes
        self.blocks -= 1


class Allocator:
    """Thread-safe allocator of aligned, leased blocks in named pools."""

    def __init__(self, data_offset: int, data_size: int, pools: dict[str, int] | None = None) -> None:
        """Carve ``pools`` (name -> reserved bytes) from the front; "default" gets the remainder.

        An explicit "default" entry is the least the remainder must hold. Pool starts are
        4 KiB aligned, so ``data_offset`` should be too.
        """
        if data_offset < 0 or data_size < 0:
            raise ValueError("data_offset and data_size must be non-negative")
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
        end = data_offset + data_size
        cursor = _align_up(data_offset, LARGE_ALIGN)
        pools = dict(pools or {})
        default_min = pools.pop(DEFAULT_POOL, 0)
        for name, reserved in pools.items():
            if reserved < 0:
                raise ValueError(f"pool {name!r} has a negative size {reserved}")
            if cursor + reserved > end:
                raise ValueError(
                    f"pool reservations {pools} (plus 4 KiB alignment) exceed the {data_size} "
                    "bytes of the arena's data region: lower them or enlarge the arena"
                )
            self._pools[name] = _Pool(name, cursor, reserved, self._lock)
            cursor = min(_align_up(cursor + reserved, LARGE_ALIGN), end)
        remainder = max(0, end - cursor)
        if remainder < default_min:
            raise ValueError(
                f"pool 'default' needs {default_min} bytes but only {remainder} remain after "
                f"the reservations {pools}: lower them or enlarge the arena"
            )
        self._pools[DEFAULT_POOL] = _Pool(DEFAULT_POOL, cursor, remainder, self._lock)
        self._next_id = 1
        self._listeners: list[Callable[[], None]] = []
        self._blocks: dict[int, tuple[Block, int]] = {}  # id -> (block, bytes taken)
        self._leases: dict[int, Counter[str]] = {}
        self._owned: dict[str, set[int]] = {}
        self._ended: dict[str, None] = {}  # owners that may lease nothing more, oldest first

    def _pool(self, name: str) -> _Pool:
        try:
            return self._pools[name]
        except KeyError:
            raise KeyError(f"unknown pool {name!r}; known pools: {sorted(self._pools)}") from None

    def allocate(
        self, nbytes: int, *, owner: str, pool: str = DEFAULT_POOL, timeout: float = 0.0, pinned: int = 0
    ) -> Block:
        """Allocate ``nbytes`` in ``pool``, leased once by ``owner``; waits ``timeout`` s.

        ``pinned``: bytes of the pool the caller holds and cannot give back while it waits (its
        own earlier blocks). A request that cannot fit beside them fails at once: no wait helps.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        align, taken = _footprint(nbytes)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            p = self._pool(pool)
            while True:
                self._check_not_ended(owner)  # also after a wait: the owner may have ended meanwhile
                offset = p.take(align, taken) if taken + pinned <= p.size else None
                if offset is not None:
                    block = Block(self._next_id, offset, nbytes, pool)
                    self._next_id += 1
                    self._blocks[block.id] = (block, taken)
                    self._leases[block.id] = Counter({owner: 1})
                    self._owned.setdefault(owner, set()).add(block.id)
                    return block
                remaining = deadline - time.monotonic()
                if taken + pinned > p.size or remaining <= 0:
                    raise ArenaFullError(self._full_message(p, nbytes, taken, timeout, pinned))
                p.cond.wait(remaining)

    def allocate_all(
        self, sizes: list[int], *, owner: str, pool: str = DEFAULT_POOL, timeout: float = 0.0
    ) -> list[Block]:
        """One block per size, all or none (each may wait ``timeout`` s); sizes that cannot fit
        the pool together fail at once, before any wait."""
        blocks: list[Block] = []
        total = sum(footprint(n) for n in sizes if n >= 0)
        try:
            for nbytes in sizes:
                pinned = total - footprint(nbytes) if nbytes >= 0 else 0  # held by, or due to, the rest
                blocks.append(self.allocate(nbytes, owner=owner, pool=pool, timeout=timeout, pinned=pinned))
        except BaseException:
            for block in blocks:
                self.release(block.id, owner)
            raise
        return blocks

    def _full_message(self, p: _Pool, nbytes: int, taken: int, timeout: float, pinned: int = 0) -> str:
        if taken > p.size:
            why = "larger than the whole pool"
        elif taken + pinned > p.size:
            why = f"it cannot fit beside the {pinned} bytes its caller holds or still needs: no wait helps"
        else:
            why = f"no room after waiting {timeout:g} s"
        return (
            f"arena pool {p.name!r} cannot hold {nbytes} bytes ({taken} with alignment; {why}): "
            f"largest free extent {p.largest_free()} bytes, reserved {p.size}, used {p.used}, "
            f"{p.blocks} live blocks. Release arrays you hold (drop references to arena views "
            f"so their blocks are freed), or raise the size of pool {p.name!r} / the arena."
        )

    def _live(self, block_id: int) -> tuple[Block, int]:
        try:
            return self._blocks[block_id]
        except KeyError:
            raise UnknownBlockError(f"block {block_id} is not live in the arena") from None

    def _leased(self, block_id: int, owner: str) -> Block:
        block, _ = self._live(block_id)
        if self._leases[block_id][owner] <= 0:
            raise UnknownBlockError(f"block {block_id} is not leased by {owner!r}")
        return block

    def acquire(self, block_id: int, owner: str) -> Block:
        """Add one lease on a live block for ``owner``."""
        with self._lock:
            block, _ = self._live(block_id)
            self._check_not_ended(owner)
            self._leases[block_id][owner] += 1
            self._owned.setdefault(owner, set()).add(block_id)
            return block

    def release(self, block_id: int, owner: str) -> bool:
        """Drop one lease of ``owner``; free the block when no lease is left. True if freed."""
        with self._lock:
            self._leased(block_id, owner)
            leases = self._leases[block_id]
            leases[owner] -= 1
            if leases[owner] <= 0:
                self._forget(block_id, owner)
            self._note_release()
            return self._free_if_unleased(block_id)

    def check(self, block_id: int, owner: str) -> Block:
        """The block, if ``owner`` holds a lease on it; else UnknownBlockError."""
        with self._lock:
            return self._leased(block_id, owner)

    def leases(self, block_id: int) -> int:
        """How many leases the block has (all owners); 0 once it is freed."""
        with self._lock:
            counts = self._leases.get(block_id)
            return sum(counts.values()) if counts else 0

    def release_owner(self, owner: str) -> int:
        """Drop every lease of ``owner`` (e.g. an expired session); return the blocks freed."""
        with self._lock:
            freed = 0
            for block_id in sorted(self._owned.get(owner, ())):
                self._forget(block_id, owner)
                freed += self._free_if_unleased(block_id)
            self._owned.pop(owner, None)
            self._note_release()
            return freed

    def end_owner(self, owner: str, keep: bool = False) -> int:
        """`release_owner` (unless `keep`: its leases stay until `release_owner`), and no new
        lease for ``owner`` ever again: a call or stream item that finishes after its session
        closed must not take blocks nobody will free."""
        with self._lock:
            self._ended[owner] = None
            if len(self._ended) > ENDED_KEPT:
                del self._ended[next(iter(self._ended))]
        return 0 if keep else self.release_owner(owner)

    def reopen_owner(self, owner: str) -> None:
        """``owner`` (a session id) is open again: it may lease blocks, which are freed when it
        ends again. A controller that ends its session and reconnects under the same id (the
        elastic manager's fresh session for a host that came back) must get blocks there."""
        with self._lock:
            self._ended.pop(owner, None)

    def owned_bytes(self, owner: str) -> int:
        """Bytes of the blocks ``owner`` holds a lease on."""
        with self._lock:
            return sum(self._blocks[b][0].nbytes for b in self._owned.get(owner, ()))

    def _check_not_ended(self, owner: str) -> None:
        if owner in self._ended:
            raise OwnerEndedError(f"{owner!r} ended (its session closed): it can hold no block")

    def notify_release_listeners(self) -> None:
        """Calls the release listeners without a lease dropped (a slot ring got back a slot it
        never published, or a borrower gave slots back)."""
        with self._lock:
            self._note_release()

    def add_release_listener(self, listener: Callable[[], None]) -> None:
        """Calls `listener()` whenever a lease is dropped (how a slot ring's user learns that a
        consumer let go); it runs under the allocator's lock, so it must be quick and must not
        call the allocator (write to a pipe)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_release_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def _note_release(self) -> None:
        """Lock held: a lease was dropped."""
        for listener in self._listeners:
            listener()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per pool: reserved, used, peak, blocks, largest_free, allocated (bytes of every
        block carved so far; alignment included)."""
        with self._lock:
            return {
                name: {
                    "reserved": p.size,
                    "used": p.used,
                    "peak": p.peak,
                    "blocks": p.blocks,
                    "largest_free": p.largest_free(),
                    "allocated": p.allocated,
                }
                for name, p in self._pools.items()
            }

    def _forget(self, block_id: int, owner: str) -> None:
        """Remove all of ``owner``'s leases on a block (lock held)."""
        self._leases[block_id].pop(owner, None)
        owned = self._owned.get(owner)
        if owned is not None:
            owned.discard(block_id)
            if not owned:
                del self._owned[owner]

    def _free_if_unleased(self, block_id: int) -> bool:
        """Free the block if nobody leases it any more, waking waiters (lock held)."""
        if +self._leases[block_id]:
            return False
        block, taken = self._blocks.pop(block_id)
        del self._leases[block_id]
        p = self._pools[block.pool]
        p.give_back(block.offset, taken)
        p.cond.notify_all()
        return True
