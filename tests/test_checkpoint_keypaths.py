"""Array directories named by key path: a saved tree's arrays lie at `arrays/params/dense/kernel`
(one segment per key, escaped), tensorstore alone opens them, colocar restores them, keys that
would collide or escape the directory do not, `colocar ckpt show` lists the paths, and a step in
the old layout (`arrays/<leaf index>`, format 2) still restores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from checkpoint_helpers import abstract, assert_same, attempt_path
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from colocar.checkpoint import CheckpointError, CheckpointManager
from colocar.checkpoint.cli import main as ckpt_main
from colocar.checkpoint.format import keypaths, layout, tree


class Adam(NamedTuple):
    mu: jax.Array
    nu: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Scale:
    value: jax.Array


@pytest.fixture
def mngr(cluster, tmp_path):
    m = CheckpointManager(str(tmp_path / "ckpt"), cluster, stale_seconds=0.5)
    yield m
    m.close()


def _nested_state() -> dict:
    """Nested dicts, a list, a NamedTuple and a dataclass; arrays sharded over the 8 devices."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(5)

    def put(shape, dtype=np.float32, spec=None):
        return jax.device_put(rng.standard_normal(shape).astype(dtype), NamedSharding(mesh, spec or P()))

    return {
        "params": {
            "dense": {"kernel": put((16, 8), spec=P("data", "model")), "bias": put(8, ml_dtypes.bfloat16)}
        },
        "layers": [put((4, 4)), {"w": put((8,), spec=P("data"))}],
        "opt": Adam(mu=put(3), nu=put(3)),
        "scale": Scale(value=put(2)),
        "host": np.arange(6, dtype=np.int16),
        "step": 7,
    }


def _manifest(directory: str, step: int) -> dict:
    return json.load(open(os.path.join(attempt_path(directory, step), layout.MANIFEST)))


def test_arrays_lie_at_their_key_paths_and_tensorstore_alone_reads_them(cluster, mngr):
    state = _nested_state()
    mngr.save(1, state)
    mngr.wait()
    arrays = os.path.join(attempt_path(mngr.directory, 1), layout.ARRAYS_DIR)
    manifest = _manifest(mngr.directory, 1)
    assert manifest["format"] == layout.FORMAT and manifest["array_layout"] == "keypath"
    expected = {
        "['params']['dense']['kernel']": "params/dense/kernel",
        "['params']['dense']['bias']": "params/dense/bias",
        "['layers'][0]": "layers/0",
        "['layers'][1]['w']": "layers/1/w",
        "['opt'].mu": "opt/mu",
        "['opt'].nu": "opt/nu",
        "['scale'].value": "scale/value",
        "['host']": "host",
    }
    assert {k: e["dir"] for k, e in manifest["leaves"].items() if e["kind"] != "value"} == expected
    for directory in expected.values():
        assert os.path.isfile(os.path.join(arrays, directory, "zarr.json")), directory
    assert sorted(os.listdir(arrays)) == ["host", "layers", "opt", "params", "scale"]
    # tensorstore alone, with nothing but the directory: the arrays as saved, bit for bit.
    for key, leaf in [
        ("['params']['dense']['kernel']", state["params"]["dense"]["kernel"]),
        ("['params']['dense']['bias']", state["params"]["dense"]["bias"]),
        ("['layers'][1]['w']", state["layers"][1]["w"]),
        ("['host']", state["host"]),
    ]:
        path = os.path.join(arrays, manifest["leaves"][key]["dir"])
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result()
        read = store.read().result()
        want = np.asarray(leaf)
        assert read.dtype == want.dtype and read.shape == want.shape
        assert read.tobytes() == want.tobytes(), key
    assert_same(mngr.restore(target=abstract(state)), state)


def test_ckpt_show_lists_the_array_paths(cluster, mngr, capsys):
    mngr.save(2, _nested_state())
    mngr.wait()
    capsys.readouterr()
    ckpt_main(["show", mngr.directory, "2"])
    out = capsys.readouterr().out
    root = f"{layout.attempt_dir(2, _manifest(mngr.directory, 2)['attempt'])}/arrays/"
    assert f"arrays (one zarr3 array each) under {root}" in out
    kernel = next(line for line in out.splitlines() if "['params']['dense']['kernel']" in line)
    assert kernel.rstrip().endswith(" params/dense/kernel/") and "float32[16, 8]" in kernel
    assert next(line for line in out.splitlines() if "['opt'].mu" in line).rstrip().endswith(" opt/mu/")
    ckpt_main(["show", mngr.directory, "2", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert shown["arrays_root"] + "/" == root
    assert shown["arrays"]["['layers'][1]['w']"] == "layers/1/w" and "['step']" not in shown["arrays"]
    assert os.path.isdir(os.path.join(mngr.directory, shown["arrays_root"], shown["arrays"]["['opt'].nu"]))


AWKWARD = ["a/b", "..", ".", "", "with space", "ünï✓", "%2F", "a%2Fb", "@", "x" * 300, "x" * 299 + "y"]


def _awkward_state(devices) -> dict:
    """Leaf `['top'][k]` holds AWKWARD.index(k) eight times; `['a']['b']` holds 99. "a/b" must
    not land where the nested a -> b does, nor ".." above the arrays root."""
    sharded = NamedSharding(Mesh(np.array(devices), ("d",)), P("d"))
    awkward = {k: jax.device_put(np.full(8, i, np.int32), sharded) for i, k in enumerate(AWKWARD)}
    return {"top": awkward, "a": {"b": jax.device_put(np.full(8, 99, np.int32), sharded)}}


def test_awkward_keys_get_distinct_directories_inside_the_arrays_root(cluster, mngr):
    state = _awkward_state(jax.devices())
    mngr.save(3, state)
    mngr.wait()
    manifest = _manifest(mngr.directory, 3)
    arrays = os.path.realpath(os.path.join(attempt_path(mngr.directory, 3), layout.ARRAYS_DIR))
    dirs = {k: e["dir"] for k, e in manifest["leaves"].items()}
    assert len(set(dirs.values())) == len(dirs) == len(AWKWARD) + 1
    assert dirs["['a']['b']"] == "a/b" and dirs["['top']['a/b']"] == "top/a%2Fb"
    assert dirs["['top']['..']"] == "top/%2E%2E" and dirs["['top']['.']"] == "top/%2E"
    assert dirs["['top']['']"] == "top/@" and dirs["['top']['%2F']"] == "top/%252F"
    values = {f"['top'][{k!r}]": i for i, k in enumerate(AWKWARD)} | {"['a']['b']": 99}
    for key, directory in dirs.items():
        path = os.path.realpath(os.path.join(arrays, directory))
        assert path.startswith(arrays + os.sep) and os.path.isfile(os.path.join(path, "zarr.json")), key
        assert all(len(part) <= keypaths.MAX_SEGMENT for part in directory.split("/"))
        stored = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result()
        assert np.asarray(stored.read().result()).tolist() == [values[key]] * 8, key
    assert_same(mngr.restore(target=abstract(state)), state)


def test_awkward_keys_round_trip_through_gcs(make_cluster, gcs_server):
    """Escaped names through tensorstore's gcs kvstore and google-cloud-storage (fake server)."""
    gcs_server.create_bucket("colocar-keypaths")
    cluster = make_cluster(hosts=2, env=gcs_server.env)
    state = _awkward_state(cluster.devices)
    with CheckpointManager("gs://colocar-keypaths/run", cluster) as m:
        m.save(1, state)
        m.wait()
        step, manifest = m.steps.committed_manifest(1)
        root = layout.arrays_root(step, manifest)
        for key, value in [("['top']['a/b']", 0), ("['top']['..']", 1), ("['top']['ünï✓']", 5)]:
            spec = {
                "driver": "zarr3",
                "kvstore": m.storage.kvstore(f"{root}/{manifest['leaves'][key]['dir']}"),
            }
            assert np.asarray(ts.open(spec).result().read().result()).tolist() == [value] * 8, key
        assert_same(m.restore(target=abstract(state)), state)
        m.save(2, state)  # then step 1 goes: every escaped object under it with it
        m.wait()
        m.delete(1)
        assert m.all_steps() == [2] and not m.storage.children(layout.step_dir(1))


def test_escaping_is_reversible_and_unique():
    names = AWKWARD + ["A", "a", "%", "%25", "~tilde", "-_.", "a.b", "\x00", "/"]
    segments = [keypaths.escape(n) for n in names]
    assert len(set(segments)) == len(names)
    for name, segment in zip(names, segments, strict=True):
        assert "/" not in segment and segment not in ("", ".", "..") and len(segment) <= keypaths.MAX_SEGMENT
        assert keypaths.decode_segment(segment) == (None if len(name) >= 300 else name)
    assert keypaths.escape("kernel") == "kernel" and keypaths.escape("a b") == "a%20b"
    assert tree.flatten(np.ones(3))[2] == {"": "@root"}  # a tree that is a single array
    dirs = tree.flatten({"a": [np.ones(1), {"": np.ones(1)}], "v": 3})[2]
    assert dirs == {"['a'][0]": "a/0", "['a'][1]['']": "a/1/@"}  # plain values have none


class _Key:
    """A sortable dict key whose str() is the same for every instance."""

    def __init__(self, n: int):
        self.n = n

    def __lt__(self, other: _Key) -> bool:
        return self.n < other.n

    def __str__(self) -> str:
        return "same"

    def __repr__(self) -> str:
        return "K"  # the two leaves' keystr are equal too

    def __hash__(self) -> int:
        return self.n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and other.n == self.n


def test_keys_that_would_share_a_directory_fail_the_save(cluster, mngr):
    one = np.ones(4, np.float32)
    with pytest.raises(CheckpointError, match=r"both be saved in arrays/same"):
        tree.flatten({_Key(1): one, _Key(2): one})
    with pytest.raises(CheckpointError, match=r"inside the array of"):
        tree.flatten({_Key(1): one, _Key(2): {"x": one}})
    with pytest.raises(CheckpointError, match=r"both be saved in arrays/same"):
        mngr.save(4, {_Key(1): one, _Key(2): one})
    assert mngr.all_steps() == []
    mngr.save(5, {"fine": one})  # the manager is still usable
    mngr.wait()
    assert mngr.all_steps() == [5]
    assert tree.flatten({_Key(1): 1, _Key(2): 2})[2] == {}  # plain values have no directory


def _to_index_layout(directory: str, step: int) -> dict:
    """Rewrites committed `step` the way format 2 wrote it: arrays/<leaf index>, no `dir`."""
    attempt = attempt_path(directory, step)
    arrays = os.path.join(attempt, layout.ARRAYS_DIR)
    manifest = _manifest(directory, step)
    os.rename(arrays, arrays + ".new")
    os.mkdir(arrays)
    for entry in manifest["leaves"].values():
        if entry["kind"] != "value":
            os.rename(
                os.path.join(arrays + ".new", entry.pop("dir")), os.path.join(arrays, str(entry["index"]))
            )
    shutil.rmtree(arrays + ".new")
    del manifest["array_layout"]
    manifest["format"] = layout.FORMAT_2
    json.dump(manifest, open(os.path.join(attempt, layout.MANIFEST), "w"))
    return manifest


def test_old_index_layout_restores_and_an_unknown_layout_is_refused(cluster, mngr, capsys):
    state = _nested_state()
    mngr.save(6, state)
    mngr.wait()
    manifest = _to_index_layout(mngr.directory, 6)
    kernel = manifest["leaves"]["['params']['dense']['kernel']"]
    arrays = os.path.join(attempt_path(mngr.directory, 6), layout.ARRAYS_DIR)
    assert os.path.isdir(os.path.join(arrays, str(kernel["index"])))
    assert not os.path.exists(os.path.join(arrays, "params"))
    assert_same(mngr.restore(step=6, target=abstract(state)), state)
    capsys.readouterr()
    ckpt_main(["show", mngr.directory, "6"])
    line = next(x for x in capsys.readouterr().out.splitlines() if "['params']['dense']['kernel']" in x)
    assert line.rstrip().endswith(f" {kernel['index']}/")
    manifest.update(format=layout.FORMAT, array_layout="flat-v9")
    json.dump(manifest, open(os.path.join(attempt_path(mngr.directory, 6), layout.MANIFEST), "w"))
    with pytest.raises(CheckpointError, match=r"step 6: unknown array layout 'flat-v9'"):
        mngr.restore(step=6, target=abstract(state))
    with pytest.raises(SystemExit) as exit_info:
        ckpt_main(["show", mngr.directory, "6"])
    assert exit_info.value.code == 2 and "unknown array layout 'flat-v9'" in capsys.readouterr().err
