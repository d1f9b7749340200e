"""Ctrl-C in a terminal, as people press it: the controller runs on a pty (its own session and
foreground process group, as a shell starts it) and the test types ^C there, so the terminal
sends SIGINT to the whole foreground group, not to one pid.

During a call on two hosts, a generator, a loader's next() (one host has handed the batch over,
the other has not) and a checkpoint wait() (its storage paused): each raises KeyboardInterrupt,
the next call returns its own result (the loader the very batch that was interrupted, the
checkpoint the state it saved), and when the program ends nothing of it is left running or in
its shm folder. The sidecars, in sessions of their own, never see the ^C.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from helpers import program, running, wait_for
from notebook_helpers import REPO

DEADLINE = 120.0
# the child's first step: make the pty on its stdin its controlling terminal, then run argv
TAKE_TERMINAL = """
import fcntl, os, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
os.execv(sys.argv[1], sys.argv[1:])
"""


class Terminal:
    """A program on a pty: its output line by line, and ^C typed into it."""

    def __init__(self, argv: list[str], env: dict[str, str], sent_at: str):
        # Started as a shell starts it: a session leader whose controlling terminal is the pty
        # (so its group is the foreground one). Not with pty.fork(): a Python-level fork of
        # this process, whose gRPC and JAX threads run, can crash the child before its exec.
        self.fd, tty = pty.openpty()
        self.process = subprocess.Popen(
            [sys.executable, "-c", TAKE_TERMINAL, *argv],
            stdin=tty,
            stdout=tty,
            stderr=tty,
            env=env,
            start_new_session=True,
        )
        os.close(tty)
        self.pid = self.process.pid
        self.output = ""
        self._sent_at = sent_at

    def expect(self, prefix: str, deadline: float = DEADLINE) -> str:
        """The rest of the first line from now on that starts with `prefix`."""
        end = time.monotonic() + deadline
        while True:
            lines = self.output.splitlines(keepends=True)
            for i, line in enumerate(lines):
                if line.endswith("\n") and line.lstrip("^C").startswith(prefix):
                    self.output = "".join(lines[i + 1 :])
                    return line.lstrip("^C")[len(prefix) :].strip()
            left = end - time.monotonic()
            assert left > 0, f"no line {prefix!r} within {deadline} s; the terminal shows:\n{self.output}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: the program ended
                    chunk = b""
                assert chunk, f"the program ended before {prefix!r}:\n{self.output}"
                self.output += chunk.decode(errors="replace").replace("\r\n", "\n")

    def ctrl_c(self) -> None:
        """Types ^C: the line discipline sends SIGINT to the terminal's foreground group."""
        with open(self._sent_at, "w") as f:
            f.write(repr(time.time()))
        os.write(self.fd, b"\x03")

    def wait(self) -> int:
        code = self.process.wait(timeout=DEADLINE)
        os.close(self.fd)
        return code


class PausableProxy:
    """A TCP proxy to a local port that can stop passing bytes: storage that stops answering
    the sidecars (their writes wait) while the controller still reaches it directly."""

    def __init__(self, port: int):
        self._target = port
        self._flowing = threading.Event()
        self._flowing.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self._flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self.resume()
        for s in self._sockets:
            s.close()


def _interrupt(term: Terminal, stage: str, started: str, folder: str) -> None:
    """Waits for the stage's remote part to start, types ^C, waits for the KeyboardInterrupt
    (the program says how long it took to come), lifts the block."""
    term.expect(f"STAGE {stage}")
    wait_for(lambda: glob.glob(os.path.join(folder, started)), f"the {stage} to start", timeout=DEADLINE)
    time.sleep(0.3)  # the program waits on it by now
    term.ctrl_c()
    term.expect(f"INTERRUPTED {stage}")
    open(os.path.join(folder, f"{stage}.go"), "w").close()


def test_ctrl_c_in_a_terminal_interrupts_each_kind_of_wait(tmp_path, gcs_server, shm_dir):
    folder = str(tmp_path)
    shm = tempfile.mkdtemp(prefix="tty", dir=shm_dir)
    gcs_server.create_bucket("terminal")
    storage = PausableProxy(gcs_server.port)
    env = {**os.environ, "COLOCAR_SHM_DIR": shm, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, program("terminal_controller"), folder, "gs://terminal/checkpoints", storage.url]
    term = Terminal(argv, env, os.path.join(folder, "sent"))
    sidecars: list[int] = []
    try:
        sidecars = [int(pid) for pid in term.expect("SIDECARS").split()]
        _interrupt(term, "call", "call-call-*", folder)
        assert term.expect("RESULT call") == "['own', 'own']"
        assert term.expect("FIRST generator") == "0"
        _interrupt(term, "generator", "generator-item-*", folder)
        assert term.expect("RESULT generator") == "[0, 1, 2]"
        assert term.expect("FIRST loader") == str(list(range(8)))
        _interrupt(term, "loader", "loader-record-*", folder)
        assert term.expect("RESULT loader") == str(list(range(8, 16)))  # the interrupted batch
        term.expect("READY checkpoint")
        storage.pause()  # the bucket stops answering the sidecars: the save cannot become durable
        open(os.path.join(folder, "paused"), "w").close()
        term.expect("STAGE checkpoint")
        time.sleep(0.5)  # let wait() block on the writers
        term.ctrl_c()
        term.expect("INTERRUPTED checkpoint")
        storage.resume()
        assert term.expect("RESULT checkpoint") == "True"
        term.expect("DONE")
        assert term.wait() == 0
        assert running(sidecars) == [] and os.listdir(shm) == []
    finally:
        storage.close()
        for pid in running(sidecars):
            os.kill(pid, signal.SIGKILL)
        term.process.kill()
        term.process.wait(timeout=DEADLINE)
        for name in os.listdir(shm):
            os.unlink(os.path.join(shm, name))
        os.rmdir(shm)
