"""Pickling of values between controller and sidecar, with large arrays kept out of the pickle.

Both sides use cloudpickle. A numpy array of at least `ARRAY_THRESHOLD` bytes is not pickled:
`dumps` hands it to a sink (which places it in an arena block, or queues it for a chunked
upload) and writes only a small reference; `loads` asks a source for the array behind each
reference (a zero-copy view of the block). So bulk bytes never travel inside an RPC message.
Arrays of object-like dtypes (`object`, `StringDType`) hold pointers: a large one is pickled
on its own and its bytes go to the sink instead.
An array that is already a whole arena block goes by reference whatever its size, so that the
block is shared (a ring slot stays leased while the receiver holds it). A pickle still larger
than `PICKLE_THRESHOLD` (a big bytes or list value) goes to the sink as bytes too.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from colocar.errors import SerializationError
from colocar.shm.views import block_of

ARRAY_THRESHOLD = 64 * 1024
PICKLE_THRESHOLD = 1 << 20  # a larger pickle travels like an array, never inside a message
_REF_TAG = "colocar.array"
_INLINE_TAG = "colocar.inline"
_PICKLED_TAG = "colocar.pickled"

# sink(array) -> index of the array in the payload's block list
ArraySink = Callable[[np.ndarray], int]
# source(index, shape, dtype) -> the array
ArraySource = Callable[[int, tuple[int, ...], np.dtype], np.ndarray]


def _as_numpy(obj: Any) -> np.ndarray | None:
    """numpy arrays as they are; jax.Arrays (without importing jax) converted on the host,
    typed PRNG key arrays as their key data (numpy has no key dtype)."""
    if type(obj) is np.ndarray:
        return obj
    module = type(obj).__module__ or ""
    if module.startswith(("jax", "jaxlib")) and hasattr(obj, "__array__") and hasattr(obj, "shape"):
        jax = sys.modules.get("jax")  # imported, since obj is a JAX value
        if jax is not None and jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
            obj = jax.random.key_data(obj)
        return np.asarray(obj)
    return None


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, sink: ArraySink | None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.persistent_id = _array_refs(sink)  # type: ignore[method-assign]


_BUILTIN_SCALARS = (int, float, complex, str, bytes, bool, type(None))
# Types no array hides behind: the pickler asks `persistent_id` about every object it meets
# (a small array's own reduction alone is some twenty), and these answer at once.
_NEVER_ARRAYS = frozenset({*_BUILTIN_SCALARS, tuple, list, dict, type})


def _array_refs(sink: ArraySink | None) -> Callable[[Any], Any]:
    def persistent_id(obj: Any) -> Any:
        if type(obj) in _NEVER_ARRAYS:
            return None
        array = _as_numpy(obj)
        if array is None:
            return None
        if sink is not None and array.dtype.hasobject and array.nbytes >= ARRAY_THRESHOLD:
            # Strings and objects hold pointers, so no view can share them: their own pickle
            # goes to a block as bytes, keeping large ones out of the RPC message all the same.
            data = np.frombuffer(cloudpickle.dumps(array, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
            return (_PICKLED_TAG, sink(data), data.size)
        if (
            sink is not None
            and not array.dtype.hasobject
            and (array.nbytes >= ARRAY_THRESHOLD or block_of(array) is not None)
        ):  # large, or already a whole arena block (a ring slot): shared, never pickled
            return (_REF_TAG, sink(array), array.shape, array.dtype)
        if array is not obj:  # a small jax.Array: travels as numpy
            return (_INLINE_TAG, array)
        return None

    return persistent_id


_PLAIN_SCALARS = frozenset(_BUILTIN_SCALARS)
_PLAIN_LIMIT = 256
_NONE = pickle.dumps(None, protocol=pickle.HIGHEST_PROTOCOL)


def _is_plain(obj: Any, budget: list[int]) -> bool:
    """Builtin data, numpy arrays and scalars only: the stdlib pickler handles these, fast and by value.
    `budget` is [nodes left, arrays seen]: a value without arrays needs no `persistent_id`."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    kind = type(obj)
    if kind in _PLAIN_SCALARS:
        return True
    if kind is np.ndarray:
        budget[1] += 1
        return not obj.dtype.hasobject
    if kind is tuple or kind is list:
        for item in obj:
            if not _is_plain(item, budget):
                return False
        return True
    if kind is dict:
        for k, v in obj.items():
            if type(k) not in _PLAIN_SCALARS or not _is_plain(v, budget):
                return False
        return True
    return issubclass(kind, np.generic)  # a numpy scalar (np.float32(1.5), np.int64(3))


def dumps(obj: Any, sink: ArraySink | None = None, what: str = "value") -> bytes:
    """Pickles obj; arrays of at least ARRAY_THRESHOLD bytes go to `sink` when one is given.

    Plain data (builtins, numpy) takes the stdlib C pickler; anything else (functions, lambdas,
    classes, jax arrays) cloudpickle, which pickles by value what the sidecar cannot import.
    """
    if obj is None:
        return _NONE
    budget = [_PLAIN_LIMIT, 0]
    plain = _is_plain(obj, budget)
    if plain and not budget[1]:  # builtins only (most calls' arguments): one C call
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise SerializationError(f"cannot pickle {what}: {_describe_unpicklable(obj, e)}") from e
        return data if sink is None or len(data) <= PICKLE_THRESHOLD else _spilled(data, sink)
    buffer = io.BytesIO()
    guarded = None if sink is None else _guarded(sink)
    try:
        if plain:
            pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
            pickler.persistent_id = _array_refs(guarded)  # type: ignore[method-assign]
        else:
            pickler = _Pickler(buffer, guarded)
        pickler.dump(obj)
        pickler.clear_memo()  # the memo must not keep the value's arrays alive
        data = buffer.getvalue()
        if guarded is not None and len(data) > PICKLE_THRESHOLD:
            data = _spill(data, guarded)
    except _SinkError as e:
        raise e.error from None  # the sink's own error (a full arena), not a pickling problem
    except Exception as e:
        raise SerializationError(f"cannot pickle {what}: {_describe_unpicklable(obj, e)}") from e
    return data


_SPILLED = object()  # stands for a pickle that went to the sink


def _spilled(data: bytes, sink: ArraySink) -> bytes:
    """`_spill`, the sink's own error (a full arena) raised as it is."""
    try:
        return _spill(data, _guarded(sink))
    except _SinkError as e:
        raise e.error from None


def _spill(data: bytes, sink: ArraySink) -> bytes:
    """A pickle too large for a message (a big bytes or list value) goes to the sink as bytes,
    like an array; the message carries only a reference to it."""
    reference = (_PICKLED_TAG, sink(np.frombuffer(data, np.uint8)), len(data))
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = lambda obj: reference if obj is _SPILLED else None  # type: ignore[method-assign]
    pickler.dump(_SPILLED)
    return buffer.getvalue()


class _SinkError(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _guarded(sink: ArraySink) -> ArraySink:
    """The sink, its failures marked so that `dumps` raises them as they are."""

    def guarded(array: np.ndarray) -> int:
        try:
            return sink(array)
        except Exception as e:
            raise _SinkError(e) from e

    return guarded


def loads(data: bytes | memoryview, source: ArraySource | None = None) -> Any:
    """Inverse of `dumps`; array references are resolved through `source`."""
    if type(data) is bytes and b"Q" not in data and b"P" not in data:
        return pickle.loads(data)  # no persistent-id opcode (BINPERSID, PERSID) can be in it
    unpickler = pickle.Unpickler(io.BytesIO(data))

    def persistent_load(pid: Any) -> Any:
        if pid[0] == _INLINE_TAG:
            return pid[1]
        if pid[0] == _PICKLED_TAG and source is not None:
            _, index, size = pid
            return loads(source(index, (size,), np.dtype(np.uint8)).data, source)
        if pid[0] != _REF_TAG or source is None:
            raise pickle.UnpicklingError(f"unexpected array reference {pid[0]!r}")
        _, index, shape, dtype = pid
        return source(index, tuple(shape), np.dtype(dtype))

    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    return unpickler.load()


def dumps_code(fn: Any, by_value_modules: tuple[Any, ...] = ()) -> bytes:
    """Pickles a function or class, shipping the given modules by value instead of by name."""
    for module in by_value_modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        return dumps(fn, None, what=f"function {getattr(fn, '__qualname__', fn)!r}")
    finally:
        for module in by_value_modules:
            cloudpickle.unregister_pickle_by_value(module)


def code_hash(code: bytes) -> bytes:
    return hashlib.sha256(code).digest()


def _describe_unpicklable(obj: Any, error: Exception) -> str:
    """Names the first element of a tuple/list/dict that fails to pickle, to point at the culprit."""
    items: list[tuple[str, Any]] = []
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], dict):
        args, kwargs = obj
        if isinstance(args, tuple):
            items = [(f"argument {i}", a) for i, a in enumerate(args)]
            items += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in items:
        try:
            cloudpickle.dumps(value)
        except Exception as inner:
            return f"{label} ({_short_repr(value)}) is not picklable: {type(inner).__name__}: {inner}"
    return f"{_short_repr(obj)} is not picklable: {type(error).__name__}: {error}"


def _short_repr(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
