"""Where checkpoints live: a local directory or a GCS prefix (runs in controller and sidecar).

Arrays go through tensorstore (`kvstore()` gives its spec); the small objects around them
(manifest, markers, heartbeat, writer lease), listing and deletion go through this class:
`os` calls for local paths and `file://` URLs, google-cloud-storage for `gs://bucket/prefix`.
Every storage call is bounded: GCS calls retry transient errors with backoff for at most
`timeout` seconds and then raise `StorageError`; tensorstore gets the same bound through its
`gcs_request_retries` context.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
from typing import Any
from urllib.parse import urlparse

from colocar.errors import ColocarError

DEFAULT_TIMEOUT = 30.0


_TS_SPEC = re.compile(r" \[tensorstore_spec='.*'\]", re.S)


def describe(error: BaseException) -> str:
    """An exception as one line, without the full spec tensorstore appends to its messages."""
    return f"{type(error).__name__}: {_TS_SPEC.sub('', str(error))}"


class StorageError(ColocarError):
    """A storage operation failed after its retries (the message names the object and cause)."""


def open_storage(url: str, timeout: float = DEFAULT_TIMEOUT) -> Storage:
    """`gs://bucket/prefix`, `file:///abs/path` or a local path."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"a checkpoint location must be a non-empty string, got {url!r}")
    if url.startswith("gs://"):
        parsed = urlparse(url)
        if not parsed.netloc:
            raise ValueError(f"{url!r}: expected gs://BUCKET/PREFIX")
        return GcsStorage(parsed.netloc, parsed.path.strip("/"), timeout)
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{url!r}: a file:// URL needs an absolute path (file:///path)")
        return LocalStorage(parsed.path)
    if "://" in url:
        raise ValueError(f"{url!r}: unsupported scheme (use gs://, file:// or a local path)")
    return LocalStorage(url)


class Storage:
    """Small objects under one root; names are '/'-separated and relative to the root."""

    url: str

    def kvstore(self, name: str) -> dict[str, Any]:
        raise NotImplementedError

    def context_spec(self) -> dict[str, Any]:
        return {}

    def read(self, name: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        raise NotImplementedError

    def write(self, name: str, data: bytes, *, create_only: bool = False) -> bool:
        """Writes durably; with `create_only`, returns False instead when the object exists."""
        raise NotImplementedError

    def children(self, name: str = "") -> list[str]:
        """Names directly under `name` (sub-directories without a trailing slash)."""
        raise NotImplementedError

    def age(self, name: str) -> float | None:
        """Seconds since the object was last written, or None when it does not exist."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def delete_tree(self, name: str) -> None:
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        return self.read(name) is not None

    can_rename = False  # a directory moves at once (local disk), or not at all (GCS)

    def rename(self, name: str, to: str) -> bool:
        """Moves directory `name` to `to` atomically; False when `to` exists already."""
        raise NotImplementedError(f"{self.url} cannot rename")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


class LocalStorage(Storage):
    def __init__(self, path: str):
        self.root = os.path.abspath(path)
        self.url = self.root

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *[p for p in name.split("/") if p])

    def kvstore(self, name: str) -> dict[str, Any]:
        return {"driver": "file", "path": self._path(name).rstrip("/") + "/"}

    def read(self, name: str) -> bytes | None:
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"cannot read {self._path(name)}: {e}") from e

    def write(self, name: str, data: bytes, *, create_only: bool = False) -> bool:
        path = self._path(name)
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if create_only:
                    try:
                        os.link(tmp, path)  # atomic, and fails when the target exists
                    except FileExistsError:
                        return False
                else:
                    os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            _fsync_dir(directory)
            return True
        except OSError as e:
            raise StorageError(f"cannot write {path}: {e}") from e

    def children(self, name: str = "") -> list[str]:
        try:
            return sorted(n for n in os.listdir(self._path(name)) if not n.startswith(".tmp-"))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(f"cannot list {self._path(name)}: {e}") from e

    def age(self, name: str) -> float | None:
        try:
            return max(0.0, time.time() - os.stat(self._path(name)).st_mtime)
        except FileNotFoundError:
            return None

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot delete {self._path(name)}: {e}") from e
        _fsync_dir(os.path.dirname(self._path(name)))

    can_rename = True

    def rename(self, name: str, to: str) -> bool:
        target = self._path(to)
        try:
            if os.path.lexists(target):
                return False
            os.rename(self._path(name), target)  # (onto an empty directory it would succeed)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False
            raise StorageError(f"cannot rename {self._path(name)} to {target}: {e}") from e
        _fsync_dir(os.path.dirname(target))
        return True

    def delete_tree(self, name: str) -> None:
        """Removes everything under `name/` (like a GCS prefix: a file named `name` stays)."""
        try:
            shutil.rmtree(self._path(name))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            raise StorageError(f"cannot delete {self._path(name)}: {e}") from e


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class GcsStorage(Storage):
    """A prefix in a GCS bucket. Honors STORAGE_EMULATOR_HOST (tests use fake-gcs-server)."""

    def __init__(self, bucket: str, prefix: str, timeout: float = DEFAULT_TIMEOUT):
        self.bucket_name = bucket
        self.prefix = prefix
        self.timeout = timeout
        self.url = f"gs://{bucket}/{prefix}".rstrip("/")
        self._bucket: Any = None

    # One client per process and storage object, created on first use (it is not picklable).
    def _client_bucket(self) -> Any:
        if self._bucket is None:
            from google.cloud import storage

            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials

                client = storage.Client(project="colocar", credentials=AnonymousCredentials())
            else:
                client = storage.Client()
            self._bucket = client.bucket(self.bucket_name)
        return self._bucket

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_bucket": None}

    def _key(self, name: str) -> str:
        return "/".join(p for p in (self.prefix, name.strip("/")) if p)

    def _retry(self) -> Any:
        from google.api_core import exceptions
        from google.api_core.retry import Retry, if_exception_type

        transient = if_exception_type(
            exceptions.TooManyRequests,
            exceptions.InternalServerError,
            exceptions.BadGateway,
            exceptions.ServiceUnavailable,
            exceptions.GatewayTimeout,
            ConnectionError,
            _requests_errors(),
        )
        return Retry(predicate=transient, initial=0.2, maximum=4.0, multiplier=2.0, timeout=self.timeout)

    def _call(self, what: str, name: str, fn: Any) -> Any:
        from google.api_core import exceptions

        try:
            return fn()
        except exceptions.NotFound as e:
            if what in ("write", "list"):  # not a missing object: the bucket itself is missing
                raise StorageError(
                    f"{what} gs://{self.bucket_name}/{self._key(name)}: bucket {self.bucket_name!r} "
                    "does not exist (or these credentials cannot see it)"
                ) from e
            raise
        except exceptions.PreconditionFailed:
            raise
        except Exception as e:
            raise StorageError(
                f"{what} gs://{self.bucket_name}/{self._key(name)} failed (gave up after "
                f"{self.timeout:.0f} s of retries): {type(e).__name__}: {e}"
            ) from e

    def kvstore(self, name: str) -> dict[str, Any]:
        return {"driver": "gcs", "bucket": self.bucket_name, "path": self._key(name).rstrip("/") + "/"}

    def context_spec(self) -> dict[str, Any]:
        # At most ~timeout seconds of retries per request (backoff doubles up to max_delay).
        retries = max(2, int(self.timeout // 4))
        return {"gcs_request_retries": {"max_retries": retries, "initial_delay": "0.2s", "max_delay": "4s"}}

    def read(self, name: str) -> bytes | None:
        from google.api_core import exceptions

        blob = self._client_bucket().blob(self._key(name))
        try:
            return self._call(
                "read", name, lambda: blob.download_as_bytes(retry=self._retry(), timeout=self.timeout)
            )
        except exceptions.NotFound:
            return None

    def write(self, name: str, data: bytes, *, create_only: bool = False) -> bool:
        from google.api_core import exceptions

        blob = self._client_bucket().blob(self._key(name))
        kwargs: dict[str, Any] = {"retry": self._retry(), "timeout": self.timeout}
        if create_only:
            kwargs["if_generation_match"] = 0
        try:
            self._call("write", name, lambda: blob.upload_from_string(data, **kwargs))
        except exceptions.PreconditionFailed:
            return False
        return True

    def children(self, name: str = "") -> list[str]:
        prefix = self._key(name)
        prefix = prefix + "/" if prefix else ""

        def run() -> list[str]:
            pages = self._client_bucket().client.list_blobs(
                self.bucket_name, prefix=prefix, delimiter="/", retry=self._retry(), timeout=self.timeout
            )
            names = [b.name[len(prefix) :] for b in pages]
            names += [p[len(prefix) :].rstrip("/") for p in pages.prefixes]
            return sorted(n for n in names if n)

        return self._call("list", name, run)

    def age(self, name: str) -> float | None:
        from google.api_core import exceptions

        blob = self._client_bucket().blob(self._key(name))
        try:
            self._call("stat", name, lambda: blob.reload(retry=self._retry(), timeout=self.timeout))
        except exceptions.NotFound:
            return None
        return max(0.0, time.time() - blob.updated.timestamp())

    def delete(self, name: str) -> None:
        from google.api_core import exceptions

        blob = self._client_bucket().blob(self._key(name))
        try:
            self._call("delete", name, lambda: blob.delete(retry=self._retry(), timeout=self.timeout))
        except exceptions.NotFound:
            pass

    def delete_tree(self, name: str) -> None:
        from google.api_core import exceptions

        prefix = self._key(name).rstrip("/") + "/"
        blobs = self._call(
            "list",
            name,
            lambda: list(
                self._client_bucket().client.list_blobs(
                    self.bucket_name, prefix=prefix, retry=self._retry(), timeout=self.timeout
                )
            ),
        )
        for blob in blobs:
            try:
                self._call(
                    "delete", blob.name, lambda b=blob: b.delete(retry=self._retry(), timeout=self.timeout)
                )
            except exceptions.NotFound:
                pass


def _requests_errors() -> type[Exception]:
    import requests

    return requests.exceptions.RequestException
