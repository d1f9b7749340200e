"""The generated gRPC modules match colocar.proto, and the serialization contract holds."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from colocar.protocol import serialization
from colocar.protocol.generate import HERE, generate


def _without_stamp(text: str) -> str:
    """The generated text less the grpcio-tools version that wrote it (the committed module
    keeps its own, which pyproject.toml's grpcio floor matches): a newer grpcio-tools release
    on a fresh machine is no change of the protocol."""
    return re.sub(r"^GRPC_GENERATED_VERSION = .*$", "", text, flags=re.M)


def test_generated_code_is_in_sync_with_the_proto(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("grpc_tools")
    for fresh in generate(tmp_path):
        committed = HERE / fresh.name
        assert _without_stamp(committed.read_text()) == _without_stamp(fresh.read_text()), (
            f"{committed.name} is stale: run `python -m colocar.protocol.generate`"
        )


def test_the_grpcio_floor_is_what_the_generated_module_checks() -> None:
    """The generated module refuses to import under an older grpcio than the one it names."""
    generated = (HERE / "colocar_pb2_grpc.py").read_text()
    stamp = re.search(r"^GRPC_GENERATED_VERSION = '([\d.]+)'", generated, re.M)
    pyproject = (HERE.parents[1] / "pyproject.toml").read_text()
    assert stamp is not None and f'"grpcio>={stamp.group(1)}"' in pyproject, stamp


def test_large_arrays_leave_the_pickle() -> None:
    big, small = np.ones(1 << 16, np.float32), np.ones(4, np.float32)
    sunk: list[np.ndarray] = []

    def sink(a: np.ndarray) -> int:
        sunk.append(a)
        return len(sunk) - 1

    data = serialization.dumps({"big": big, "small": small}, sink)
    assert len(sunk) == 1 and sunk[0] is big
    assert len(data) < 1024
    back = serialization.loads(data, lambda i, shape, dtype: sunk[i].reshape(shape).astype(dtype))
    np.testing.assert_array_equal(back["big"], big)
    np.testing.assert_array_equal(back["small"], small)


def test_large_string_and_object_arrays_leave_the_pickle_as_bytes() -> None:
    """They hold pointers, so they cannot be shared as views; their own pickle goes to the sink
    (an arena block, or a chunked upload), never into the RPC message."""
    strings = np.array([f"row {i}" for i in range(1 << 13)], dtype=np.dtypes.StringDType())
    objects = np.array([{"k": i} for i in range(1 << 13)], dtype=object)
    sunk: list[np.ndarray] = []

    def sink(a: np.ndarray) -> int:
        sunk.append(a.copy())
        return len(sunk) - 1

    data = serialization.dumps((strings, {"objects": objects, "few": strings[:3]}), sink)
    assert len(sunk) == 2 and all(a.dtype == np.uint8 for a in sunk)
    assert len(data) < 1024
    back = serialization.loads(data, lambda i, shape, dtype: sunk[i].reshape(shape).view(dtype))
    assert back[0].dtype == strings.dtype and np.array_equal(back[0], strings)
    assert list(back[1]["objects"]) == list(objects) and list(back[1]["few"]) == ["row 0", "row 1", "row 2"]


def test_unpicklable_argument_is_named() -> None:
    import threading

    with pytest.raises(serialization.SerializationError, match="argument 1"):
        serialization.dumps(((1, threading.Lock()), {}), what="the arguments of f")


def test_plain_values_take_the_fast_paths_and_round_trip() -> None:
    """Builtins without arrays are pickled by one C call (the same bytes as the stdlib's) and
    unpickled without a persistent-id hook unless the pickle could hold a reference; values with
    arrays, bytes holding the opcode letters, memoryviews and spilled pickles still round-trip."""
    import pickle

    sent: list[np.ndarray] = []

    def sink(array: np.ndarray) -> int:
        sent.append(array)
        return len(sent) - 1

    plain = ((1, 2.5, "PQ", b"QP", None, True, np.float32(1.5)), {"k": [1, {"n": np.int64(2)}]})
    data = serialization.dumps(plain, sink)
    assert data == pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL) and not sent
    assert serialization.loads(data) == plain and serialization.loads(memoryview(data)) == plain
    assert type(serialization.loads(data)[0][6]) is np.float32
    assert serialization._is_plain(np.float32(1.5), [1, 0])  # the fast path: numpy scalars too
    big = np.arange(serialization.ARRAY_THRESHOLD, dtype=np.uint8)
    data = serialization.dumps(((big, 3), {}), sink)
    assert len(sent) == 1 and len(data) < 1000
    (array, three), _ = serialization.loads(data, lambda i, shape, dtype: sent[i].reshape(shape).view(dtype))
    assert three == 3 and np.array_equal(array, big)
    large = b"x" * (serialization.PICKLE_THRESHOLD + 1)
    data = serialization.dumps(((large,), {}), sink)
    assert len(sent) == 2 and len(data) < 1000
    assert serialization.loads(data, lambda i, shape, dtype: sent[i]) == ((large,), {})
