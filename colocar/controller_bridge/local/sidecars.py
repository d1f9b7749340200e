"""A sidecar process that `local_cluster` started: its process, log, ready pipe and files.

Each sidecar runs in a session (and process group) of its own: a terminal's Ctrl-C reaches the
whole foreground process group, and Jupyter interrupts (and, on a restart, kills) the kernel's
process group, so sidecars in the controller's group would shut down on the first interrupt (or
die without removing their arena). Outside that group they still end with the controller: one
started with `--parent-pid` exits once its parent is gone.

A sidecar of a persistent, named local cluster that an earlier controller started is
*adopted* by the controller that reattaches to it (`adopt`): this process did not start it, so
it is watched and stopped through its pid (`_Adopted`, the part of `Popen` used here).

The sidecar says it is ready with one JSON line (address, pid, arena) on a pipe it inherits
(`--ready-fd`); `wait_ready` waits on every sidecar's pipe at once (a selector, no polling)
and fails as soon as one ends without its line (the sidecar exited).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil

from colocar.errors import ColocarError

from . import records

if TYPE_CHECKING:
    from ..connection import HostConnection
    from .exits import ExitWatch


class _Adopted:
    """A sidecar process another controller started, as far as `Popen` is used here. It is the
    recorded process only while its start time matches (`records.process_of`): a number the
    system gave to another process since is never waited on nor signalled."""

    def __init__(self, host: dict[str, Any]):
        self.pid = int(host["pid"])
        self._process = records.process_of(host)

    def poll(self) -> int | None:
        """None while it runs; 0 once it ended (its exit status is its parent's to know)."""
        return None if records.alive(self._process) else 0

    def wait(self, timeout: float | None = None) -> int:
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except psutil.TimeoutExpired:
                raise subprocess.TimeoutExpired(f"sidecar pid {self.pid}", timeout or 0.0) from None
            except psutil.NoSuchProcess:
                pass
        return 0

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                self._process.send_signal(sig)  # type: ignore[union-attr]

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Sidecar:
    """One sidecar process of a local cluster and its files."""

    process: subprocess.Popen | _Adopted

    def __init__(self, index: int, workdir: str, label: str = ""):
        self.index = index
        self.label = label or f"host{index}"  # names its arena file and its log lines
        self.log_file = os.path.join(workdir, f"{self.label}.log")
        self.info: dict[str, Any] | None = None
        self.ready_fd: int | None = None
        self.terminated = False

    def adopt(self, info: dict[str, Any]) -> Sidecar:
        """This sidecar is the recorded one `info` describes (address, pid, start, arena)."""
        self.info = info
        self.process = _Adopted(info)
        return self

    def spawn(self, argv: list[str], env: dict[str, str], tied: Callable[[], None] | None = None) -> Sidecar:
        """Starts the process (again, after `restart_host`: its log is appended to). It says it
        is ready on a pipe (`--ready-fd`), which `wait_ready` waits on (no polling). In a
        session of its own, out of the controller's process group; with `tied` (run in the
        child before it starts, e.g. a parent-death signal) in the caller's instead."""
        self.info = None
        self.terminated = False
        self._ready_buffer = b""
        read_end, write_end = os.pipe()
        try:
            with open(self.log_file, "ab") as log:
                self.process = subprocess.Popen(
                    [*argv, "--ready-fd", str(write_end), "--label", self.label],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=tied is None,  # out of the controller's process group
                    preexec_fn=tied,
                    pass_fds=(write_end,),
                )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        os.set_blocking(read_end, False)
        self.ready_fd = read_end
        return self

    def poll_ready(self) -> bool:
        """Reads what the sidecar wrote on its ready pipe so far; True once its line is whole."""
        if self.info is None and self.ready_fd is not None:
            try:
                chunk = os.read(self.ready_fd, 65536)
            except BlockingIOError:
                return False
            self._ready_buffer += chunk
            if self._ready_buffer.endswith(b"\n"):
                self.info = json.loads(self._ready_buffer)
            if self.info is not None or not chunk:  # the line, or the end (the sidecar exited)
                self.close_ready_fd()
        return self.info is not None

    def close_ready_fd(self) -> None:
        if self.ready_fd is not None:
            os.close(self.ready_fd)
            self.ready_fd = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_file, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def status(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        if isinstance(self.process, _Adopted):
            return f"sidecar process {self.process.pid} exited"
        return f"sidecar process exited with code {code}"

    def watch_exit(self, exits: ExitWatch, connection: HostConnection) -> None:
        """As soon as this process exits, marks `connection`'s session lost and removes the
        files it could not (killed: an OOM kill leaves its arena's memory taken until someone
        deletes the file). Bound to this process and connection: a later one, after
        `restart_host`, is never marked, nor are its files removed, by the old one's exit."""
        session, files = connection.session, self.files()

        def exited() -> None:
            session.mark_lost(self.status() or "sidecar process exited")
            _remove(files)

        exits.watch(self.process.pid, exited)

    def terminate(self) -> None:
        """Asks the sidecar to drain and exit (SIGTERM, once); `stop` waits for it."""
        if self.process.poll() is None and not self.terminated:
            self.process.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, grace: float) -> None:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.remove_files()

    def files(self) -> list[str]:
        """The arena and link socket of the running sidecar (none before it said it is ready)."""
        arena = (self.info or {}).get("arena")
        return [arena, arena.removesuffix(".arena") + ".sock"] if arena else []

    def remove_files(self) -> None:
        """The arena and link socket of a sidecar killed before it could remove them."""
        _remove(self.files())


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def wait_ready(sidecars: list[Sidecar], startup_timeout: float) -> None:
    """Waits until every sidecar said it is ready on its pipe; fails at once if one exited."""
    deadline = time.monotonic() + startup_timeout
    try:
        with selectors.DefaultSelector() as selector:
            for s in sidecars:
                if not s.poll_ready() and s.ready_fd is not None:
                    selector.register(s.ready_fd, selectors.EVENT_READ, s)
            while not all(s.info is not None for s in sidecars):
                for s in sidecars:
                    if s.info is None and s.ready_fd is None:  # its pipe ended without the line
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            s.process.wait(timeout=5)  # for the end of its log
                        raise ColocarError(f"sidecar {s.label} failed to start:\n{s.log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ColocarError(f"sidecars did not start within {startup_timeout} s")
                for key, _ in selector.select(timeout=min(left, 1.0)):
                    sidecar: Sidecar = key.data
                    fd = key.fd
                    if sidecar.poll_ready() or sidecar.ready_fd is None:
                        selector.unregister(fd)
    finally:
        for s in sidecars:
            s.close_ready_fd()
