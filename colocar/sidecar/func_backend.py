"""Shipped code on the sidecar: the content-addressed cache and turning exceptions into replies.

Functions and classes arrive cloudpickled with their sha256; later calls send only the hash.
An unknown hash (new sidecar, evicted entry) raises `CodeNotFound`, answered as NOT_FOUND so
the controller resends the code.
"""

from __future__ import annotations

import collections
import threading
import traceback
from typing import Any

import cloudpickle

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import serialization

MAX_CACHED_CODE = 4096


class CodeNotFound(LookupError):
    pass


class CodeLoadError(RuntimeError):
    """Shipped code could not be unpickled here (usually a module missing on the sidecar)."""


class CodeCache:
    """Unpickled functions and classes by content hash, least recently used evicted."""

    def __init__(self, capacity: int = MAX_CACHED_CODE):
        self._capacity = capacity
        self._entries: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, code_hash: bytes, code: bytes, name: str) -> Any:
        with self._lock:
            fn = self._entries.get(code_hash)
            if fn is not None:
                self._entries.move_to_end(code_hash)
                return fn
        if not code:
            raise CodeNotFound(name)
        if serialization.code_hash(code) != code_hash:
            raise CodeLoadError(f"code of {name} does not match its hash")
        fn = load_code(code, name)
        with self._lock:
            self._entries[code_hash] = fn
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return fn


def load_code(code: bytes, name: str) -> Any:
    try:
        return serialization.loads(code)
    except ModuleNotFoundError as e:
        raise CodeLoadError(
            f"{name} needs module {e.name!r}, which is not importable on this sidecar: install "
            f"it in the sidecar's image, or ship it with @colocated(ship_modules=[{e.name}])"
        ) from e
    except Exception as e:
        raise CodeLoadError(f"cannot unpickle {name} here: {type(e).__name__}: {e}") from e


def error_fields(exc: BaseException) -> tuple[bytes, str, str, str]:
    """(pickled exception or b'', 'module.Type', message, formatted traceback)."""
    try:
        pickled = cloudpickle.dumps(exc)
        serialization.loads(pickled)  # an exception that cannot come back is sent as text only
    except Exception:
        pickled = b""
    cls = type(exc)
    return (
        pickled,
        f"{cls.__module__}.{cls.__qualname__}",
        str(exc),
        "".join(traceback.format_exception(exc)),
    )


def remote_error(exc: BaseException) -> pb.RemoteError:
    pickled, type_name, message, tb = error_fields(exc)
    return pb.RemoteError(exception=pickled, type=type_name, message=message, traceback=tb)
