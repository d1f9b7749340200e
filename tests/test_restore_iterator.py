"""Restoring the data iterator with the state: the README's loop (save the iterator's state
beside the arrays, build the target with `abstract`, restore, `set_state`) with a real loader
on the session cluster, and None targets at saved subtrees.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from checkpoint_helpers import assert_same
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from loaders_helpers import config, labels, take

import colocar
from colocar import loaders
from colocar.checkpoint import CheckpointError, CheckpointManager


def _state(seed: int) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    w = np.random.default_rng(seed).standard_normal((16, 8), np.float32)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))), "step": seed}


def test_readme_loop_restores_the_iterator_exactly(cluster, tmp_path):
    with loaders.load(config(), cluster) as it:
        uninterrupted = take(it, 6, labels)
    state = _state(3)
    with CheckpointManager(str(tmp_path / "ckpt"), cluster) as mngr, loaders.load(config(), cluster) as it:
        take(it, 3, labels)
        mngr.save(3, {"state": state, "data": it.get_state()})
        mngr.wait()
        take(it, 2, labels)  # the iterator moves on; the restore must bring it back
        target = {"state": colocar.checkpoint.abstract(state), "data": None}
        restored = mngr.restore(target=target)
        it.set_state(restored["data"])
        assert take(it, 3, labels) == uninterrupted[3:6]
    assert restored["data"]["next_batch"] == 3
    assert_same(restored["state"]["w"], state["w"])
    assert restored["state"]["w"].sharding == state["w"].sharding and restored["state"]["step"] == 3


def test_the_iterator_itself_is_saved_as_its_state(cluster, tmp_path):
    with loaders.load(config(), cluster) as it:
        uninterrupted = take(it, 5, labels)
    state = _state(2)
    with CheckpointManager(str(tmp_path / "ckpt"), cluster) as mngr, loaders.load(config(), cluster) as it:
        take(it, 2, labels)
        mngr.save(2, {"state": state, "data": it})
        mngr.wait()
        take(it, 1, labels)
        target = colocar.checkpoint.abstract({"state": state, "data": it})
        assert target["data"] is None and isinstance(target["state"]["w"], jax.ShapeDtypeStruct)
        restored = mngr.restore(target=target)
        it.set_state(restored["data"])
        assert take(it, 3, labels) == uninterrupted[2:5]
        assert mngr.restore(keys=["data"])["data"] == restored["data"]


def test_none_at_nested_and_listed_subtrees(cluster, tmp_path):
    saved = {
        "meta": {"run": {"name": "r7", "tags": ["a", "b"], "n": {1: 10}}, "lr": 0.5},
        "w": _state(1)["w"],
    }
    with CheckpointManager(str(tmp_path / "ckpt"), cluster) as mngr:
        mngr.save(1, saved)
        mngr.wait()
        got = mngr.restore(target={"meta": {"run": None, "lr": None}})
        assert got == {"meta": {"run": {"name": "r7", "tags": ["a", "b"], "n": {"1": 10}}, "lr": 0.5}}
        assert mngr.restore(target={"meta": {"run": {"tags": None}}})["meta"]["run"]["tags"] == ["a", "b"]
        whole = mngr.restore(target={"meta": None, "w": None})  # arrays as saved, too
        assert_same(whole["w"], saved["w"])
        assert whole["meta"] == got["meta"]
        with pytest.raises(CheckpointError, match=r"\['metadata'\]: not in step 1"):
            mngr.restore(target={"metadata": None})
        with pytest.raises(CheckpointError, match=r"\['meta'\]\['ru'\]: not in step 1"):
            mngr.restore(target={"meta": {"ru": None}})
        # get_state() that is not a dict (numpy's RandomState: a tuple) is not taken for a state
        with pytest.raises(CheckpointError, match=r"\['rng'\]: cannot save a leaf of type RandomState"):
            mngr.save(2, {"rng": np.random.RandomState(0)})
