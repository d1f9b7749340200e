"""Input pipelines under multi-controller JAX: two JAX processes (jax.distributed on CPU, 4
devices each), each connected to its own sidecar, load one pipeline over their global mesh.
Each feeds only its devices' rows, and the global batches are bit-identical to those one
controller loads from a two-host `local_cluster`, also after get_state / set_state.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from checkpoint_helpers import MiB
from loaders_helpers import B, config
from multi_helpers import run_two

import colocar
from colocar import loaders
from colocar.errors import ColocarError


def _reference(cluster, n: int) -> list[dict[str, np.ndarray]]:
    """The first n global batches one controller loads from the session's two hosts."""
    c = cluster.make_current()
    with loaders.load(config(batch_axes=["data"]), c, c.mesh(("data",))) as it:
        return [{name: np.array(array) for name, array in next(it).items()} for _ in range(n)]


def _assembled(results: list[dict], part: str, j: int | None) -> dict[str, np.ndarray]:
    """Batch j of `part` (or `part` itself, a batch), put together from both processes' rows;
    each row comes from exactly one process (replicas within a process count once)."""
    batch = {}
    mine = [r[part] if j is None else r[part][j] for r in results]
    for name in mine[0]:
        pieces = sorted((start, data) for m in mine for start, data in m[name].items())
        starts = [start for start, _ in pieces]
        assert len(set(starts)) == len(starts), f"{name}: rows {starts} loaded by both processes"
        batch[name] = np.concatenate([data for _, data in pieces])
        assert batch[name].shape[0] == B, f"{name}: the processes' rows {starts} do not make the batch"
    return batch


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


def _run(make_cluster, directory) -> list[dict]:
    """Runs tests/programs/loaders_multi.py as processes 0 and 1; their results."""
    run_two(make_cluster(hosts=2, arena_size=16 * MiB, persist=True), "loaders_multi", str(directory))
    return [pickle.load(open(os.path.join(directory, f"process{i}.pkl"), "rb")) for i in range(2)]


def test_two_jax_processes_load_the_single_controller_batches(make_cluster, tmp_path, cluster):
    """Each process feeds its own devices' rows (half of each batch) from its own sidecar; put
    together they are the single-controller batches, bit for bit, and a fresh iterator given
    get_state's state continues exactly. Processes that disagree (get_state at different
    batches, other seeds, one never asking) fail, naming the process; a mesh whose local
    devices no sidecar of the process covers fails naming them."""
    results = _run(make_cluster, tmp_path)
    reference = _reference(cluster, 5)
    for i, r in enumerate(results):  # each process loaded only its half of the batch
        labels = r["first"][0]["label"]
        held = [row for start, data in labels.items() for row in range(start, start + len(data))]
        assert sorted(held) == list(range(i * B // 2, (i + 1) * B // 2))
    parts = (("first", (0, 1, 2)), ("continued", (3, 4)), ("resumed", (3, 4)))
    for part, ks in (*parts, ("default_mesh", (0,)), ("two_hosts_each", (0,))):
        for j, k in enumerate(ks):
            got = _assembled(results, part, j if part in dict(parts) else None)
            assert _same(got, reference[k]), f"{part} batch {k}"
    states = [(r["state"]["next_batch"], r["state_after"]["next_batch"]) for r in results]
    assert results[0]["state"] == results[1]["state"] and states == [(3, 5), (3, 5)]
    assert [k.rsplit("/", 2)[-2] for k in results[0]["kept_keys"]] == ["1"] * 3  # 2 values, 1 verdict
    _check_errors(results)


def _check_errors(results: list[dict]) -> None:
    alone = results[0]["alone"]
    assert "JAX process 1 did not check get_state within 2 s" in alone, alone
    for i, r in enumerate(results):
        assert "get_state of the input pipeline" in r["disagree"], r.get("disagree")
        assert "JAX process 1 has" in r["disagree"] and '"next_batch": 6' in r["disagree"]
        other_seed = r["other_seed"]
        assert "load of the input pipeline" in other_seed and '"seed": 8' in other_seed, other_seed
        assert f"JAX process {i} of 2" in r["uncovered"], r.get("uncovered")
        assert f"devices {r['uncovered_ids']}" in r["uncovered"]
        warned = r["local_mesh_warnings"]
        assert len(warned) == 1 and f"only JAX process {i}'s devices" in warned[0], warned


def test_a_mesh_device_no_sidecar_covers_is_named(cluster):
    """One controller whose cluster covers half the mesh: the error names the other devices and
    the process, before any pipeline starts (it said "belongs to no host" for the first one)."""
    c = cluster.make_current()
    with colocar.connect([c.hosts[0].address], token_file=c.token_file, devices=[c.hosts[0].devices]) as half:
        with pytest.raises(ColocarError) as raised:
            loaders.load(config(), half, c.mesh(("data",)))
    message = str(raised.value)
    assert "devices [4, 5, 6, 7] of the mesh, local to JAX process 0 of 1" in message, message
    assert "'host0': [0, 1, 2, 3]" in message
    c.make_current()
