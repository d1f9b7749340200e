"""What the pool's long-running processes (the agent, a node) share: their log lines, their
gRPC server, their stop on SIGTERM or SIGINT, and the ready line on `--ready-fd`."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc


def log_to_stderr(label: str) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {label} %(levelname)s %(message)s", stream=sys.__stderr__
    )


def start_server(
    add: Callable[[grpc.Server], None], address: str, workers: int, name: str
) -> tuple[grpc.Server, int]:
    """A started gRPC server on `address` with what `add` puts on it, and its port; exits
    with a message when the address cannot be bound."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name))
    add(server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise SystemExit(f"{name}: cannot bind {address}")
    server.start()
    return server, port


def stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT run `stop` in a thread of its own (a handler must not block)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=stop).start())


def announce(fd: int | None, info: dict[str, Any]) -> None:
    """Writes the one JSON line that says the process is ready (what `wait_ready` reads)."""
    if fd is None:
        return
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info) + "\n")
