"""The arena: one pre-sized shared-memory file per sidecar, pre-faulted by its creator.

Runs in the sidecar (which creates and owns the arena) and in any process on the
same host (which attaches to it). The owner holds an exclusive ``flock`` on the
file for its whole life, so an arena whose lock can be taken belongs to a dead
process and may be removed (:func:`remove_stale_arenas`).

File layout: a header of :data:`HEADER_BYTES` bytes (magic, format version, size,
nonce, owner pid), then the data region handed out by the allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import mmap
import os
import re
import secrets
import shutil
import struct
import threading
import time
import weakref

HEADER_BYTES = 4096
MAGIC = b"COLOCAR1"
FORMAT_VERSION = 1
# magic, version, reserved, total size, nonce, owner pid
_HEADER = struct.Struct("<8sIIQ16sQ")
_LABEL_RE = re.compile(r"^[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*$")
_GLOB = "colocar-*.arena"


class ShmUnavailableError(RuntimeError):
    """The arena cannot be created or attached (no space, wrong nonce, missing file)."""


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    """Map ``fd`` shared and read-write; with ``populate``, pre-faulting the pages where the OS
    allows (the creator: the arena's memory is all there from the start). An attaching process
    (the controller, every worker) maps lazily: pre-faulting would cost it a page-table entry per
    page of the whole arena at start (~50 ms per 256 MiB) and count the whole arena in its RSS,
    while it touches only the blocks it uses; the pages exist already, so a first touch is a
    minor fault. The controller, which copies every save and batch through it, maps the rest on
    a thread after attaching (`Arena.prefault_in_background`)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    try:
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        if e.errno != errno.EINVAL or flags == mmap.MAP_SHARED:
            raise
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL and map on first touch


def _prefault(mm: mmap.mmap, size: int) -> None:
    """Pre-faults every page of ``mm`` writable, as MAP_POPULATE would have, without touching
    the data. The buffer export keeps the mapping alive meanwhile (a `close` leaves it to the
    export); ctypes releases the GIL for the call."""
    try:
        anchor = ctypes.c_char.from_buffer(mm)
    except (ValueError, TypeError):  # closed already
        return
    try:
        ctypes.CDLL(None, use_errno=True).madvise(
            ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), _MADV_POPULATE_WRITE
        )
    finally:
        del anchor


def _address_of(mm: mmap.mmap) -> int:
    """Address of byte 0 of ``mm`` in this process (the buffer export is dropped at once)."""
    c = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _no_space_message(shm_dir: str, size: int) -> str:
    try:
        free = shutil.disk_usage(shm_dir).free
        free_text = f"{free} bytes ({free / 2**30:.2f} GiB) free"
    except OSError:
        free_text = "unknown free space"
    return (
        f"cannot create a shared-memory arena of {size} bytes ({size / 2**30:.2f} GiB) in "
        f"{shm_dir!r}: no space left ({free_text}). Lower the arena size, or enlarge "
        f"{shm_dir!r} (e.g. `mount -o remount,size=... /dev/shm`, docker --shm-size, or the "
        "sizeLimit of the Kubernetes emptyDir{medium: Memory} volume, which also counts "
        "against the container's memory limit)."
    )


class Arena:
    """A shared-memory file mapped into this process; see the module docstring."""

    path: str
    size: int
    nonce: str

    def __init__(self, path: str, size: int, nonce: str, mm: mmap.mmap, lock_fd: int | None) -> None:
        """Internal: use :meth:`create` or :meth:`attach`."""
        self.path = path
        self.size = size
        self.nonce = nonce
        self._mmap: mmap.mmap | None = mm
        self._base = _address_of(mm)
        self._lock_fd = lock_fd
        self._unlinked = False
        # Owner: keep the locked fd open for our whole life, close it if we are dropped.
        self._fd_finalizer = weakref.finalize(self, os.close, lock_fd) if lock_fd is not None else None

    @classmethod
    def create(cls, shm_dir: str, size: int, *, label: str = "sidecar") -> Arena:
        """Create, lock, pre-fault and map a new arena file of ``size`` bytes in ``shm_dir``."""
        if size <= HEADER_BYTES:
            raise ValueError(f"arena size {size} must exceed the header of {HEADER_BYTES} bytes")
        if not _LABEL_RE.match(label):
            raise ValueError(f"arena label {label!r} may hold only letters, digits, '_', '.', '-'")
        name = f"colocar-{label}-{os.getpid()}-{secrets.token_hex(8)}.arena"
        path = os.path.join(shm_dir, name)
        # Build under a name the stale-arena sweep ignores, lock it, then rename into place:
        # a file matching the glob is always either locked by a live owner or stale.
        tmp_path = os.path.join(shm_dir, f".{name}.tmp")
        try:
            fd = os.open(tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise ShmUnavailableError(f"cannot create an arena file in {shm_dir!r}: {e}") from e
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise ShmUnavailableError(_no_space_message(shm_dir, size)) from e
                raise
            mm = _map(fd, size, populate=True)
            nonce = secrets.token_bytes(16)
            mm[: _HEADER.size] = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, size, nonce, os.getpid())
            os.rename(tmp_path, path)
        except BaseException:
            try:
                os.unlink(tmp_path)
            except OSError:
                pass
            os.close(fd)
            raise
        return cls(path, size, nonce.hex(), mm, fd)

    @classmethod
    def attach(cls, path: str, size: int, nonce: str) -> Arena:
        """Map an existing arena; ShmUnavailableError if its size, magic or nonce differ."""
        hint = "the sidecar is probably not on this host, or uses another shm directory"
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ShmUnavailableError(f"cannot open arena {path!r} ({e}): {hint}") from e
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ShmUnavailableError(f"arena {path!r} has {actual} bytes, expected {size}: {hint}")
            mm = _map(fd, size, populate=False)
        finally:
            os.close(fd)
        magic, version, _, hsize, hnonce, _pid = _HEADER.unpack_from(mm, 0)
        problem = None
        if magic != MAGIC:
            problem = f"bad magic {magic!r}"
        elif version != FORMAT_VERSION:
            problem = f"format version {version}, expected {FORMAT_VERSION}"
        elif hsize != size:
            problem = f"header says {hsize} bytes, expected {size}"
        elif hnonce.hex() != nonce.lower():
            problem = "nonce differs"
        if problem is not None:
            mm.close()
            raise ShmUnavailableError(f"arena {path!r} is not the expected one ({problem}): {hint}")
        return cls(path, size, hnonce.hex(), mm, None)

    def prefault_in_background(self) -> None:
        """Maps every page of an attached arena on a daemon thread: the process that copies
        saves and batches through it (the controller) then pays no page fault on a first
        touch, and attaching stays instant (see `_map`)."""
        if self._mmap is not None:
            args = (self._mmap, self.size)
            threading.Thread(target=_prefault, args=args, name="colocar-arena-prefault", daemon=True).start()

    @property
    def owner(self) -> bool:
        """True in the process that created (and locks) this arena."""
        return self._lock_fd is not None

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._mmap is None

    @property
    def base_address(self) -> int:
        """Address of byte 0 of the mapping in this process."""
        return self._base

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """Writable view of data-region bytes [offset, offset + nbytes); ValueError if outside."""
        if self._mmap is None:
            raise ValueError(f"arena {self.path!r} is closed")
        if nbytes < 0 or offset < HEADER_BYTES or offset + nbytes > self.size:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) is outside the data region "
                f"[{HEADER_BYTES}, {self.size}) of arena {self.path!r}"
            )
        return memoryview(self._mmap)[offset : offset + nbytes]

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies inside this mapping's data region."""
        return (
            nbytes >= 0
            and self._base + HEADER_BYTES <= address
            and address + nbytes <= self._base + self.size
        )

    def close(self) -> None:
        """Unmap and drop the owner's lock; never raises. Mapped until exported views die."""
        mm, self._mmap = self._mmap, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still alive: the mmap object unmaps when the last one dies
            except Exception:  # noqa: BLE001 - close must never raise
                pass
        if self._fd_finalizer is not None:
            try:
                self._fd_finalizer()
            except Exception:  # noqa: BLE001
                pass

    def unlink(self) -> None:
        """Remove the arena file (owner only); idempotent. Existing mappings stay valid."""
        if not self.owner:
            raise PermissionError(f"only the creator of arena {self.path!r} may unlink it")
        if self._unlinked:
            return
        self._unlinked = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        state = "closed" if self.closed else "open"
        return f"Arena({self.path!r}, size={self.size}, {role}, {state})"


def remove_stale_arenas(shm_dir: str) -> list[str]:
    """Remove arena files in ``shm_dir`` whose owner process is dead (its flock is free), with
    the local-link socket beside each, half-made arenas of creators that died (their
    ``.tmp`` files, locked the same way) and sockets whose arena is gone.

    Files of other users, unreadable files and arenas of live processes are left alone.
    """
    removed: list[str] = []
    # a creator locks its .tmp file just after making it: one younger than a minute may be new
    half_made = [p for p in glob.glob(os.path.join(shm_dir, f".{_GLOB}.tmp")) if _age(p) > 60.0]
    for path in sorted(glob.glob(os.path.join(shm_dir, _GLOB))) + sorted(half_made):
        if _remove_if_unlocked(path):
            removed.append(path)
    for sock in sorted(glob.glob(os.path.join(shm_dir, _GLOB.removesuffix(".arena") + ".sock"))):
        if not os.path.exists(sock.removesuffix(".sock") + ".arena") and _ours(sock):
            with contextlib.suppress(OSError):
                os.unlink(sock)
                removed.append(sock)
    return removed


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _ours(path: str) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_uid == os.getuid() and not os.path.islink(path)
    except OSError:
        return False


def _remove_if_unlocked(path: str) -> bool:
    """Removes an arena file nobody holds the lock of (and its socket); True if it did."""
    try:
        if not _ours(path) or not os.path.isfile(path):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live owner holds the lock
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except OSError:
            same = False  # removed meanwhile by another sweeper
        if not same:
            return False
        try:
            os.unlink(path)
        except OSError:
            return False
        # the owner's local-link socket lies beside its arena
        with contextlib.suppress(OSError):
            os.unlink(path.removesuffix(".arena") + ".sock")
        return True
    finally:
        os.close(fd)
