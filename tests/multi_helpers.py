"""Multi-controller JAX tests: tests/programs/<name>.py run as JAX processes 0 and 1 (CPU,
jax.distributed on localhost), each on its own sidecar of a `persist=True` cluster."""

from __future__ import annotations

import subprocess
import sys

from helpers import program


def two_processes(name: str, sidecars, directory: str, *extra: str) -> list[subprocess.Popen]:
    """Starts tests/programs/<name>.py (see ckpt_processes.py) as processes 0 and 1, each on its
    own sidecar; `extra` arguments follow the common ones."""
    return processes(name, sidecars, directory, 2, *extra)


def processes(name: str, sidecars, directory: str, count: int, *extra: str) -> list[subprocess.Popen]:
    """As `two_processes`, as processes 0 to `count - 1` on the first `count` sidecars."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [
        subprocess.Popen(
            [
                sys.executable,
                program(name),
                str(i),
                port,
                sidecars.hosts[i].address,
                sidecars.token_file,
                directory,
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(count)
    ]


def run_two(sidecars, name: str, directory: str, *extra: str) -> list[str]:
    """Runs `name` as processes 0 and 1 to their end; their outputs (each must print "OK")."""
    trainers = two_processes(name, sidecars, directory, *extra)
    try:
        outputs = [t.communicate(timeout=240)[0] for t in trainers]
        for t, out in zip(trainers, outputs, strict=True):
            assert t.returncode == 0 and "OK" in out, out[-3000:]
    finally:
        stop(trainers)
    return outputs


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()
