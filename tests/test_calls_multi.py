"""`@colocated` calls under multi-controller JAX: two JAX processes (jax.distributed on CPU, 4
devices each), each connected to its own sidecar, call with the same global arrays. Each runs
on its own sidecar with its devices' blocks and gets global `jax.Array`s whose addressable
shards are right (tests/programs/calls_multi.py checks them against numpy); non-array results
are its own host's; calls that cannot run name the process and the devices.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from checkpoint_helpers import MiB
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multi_helpers import run_two

import colocar
from colocar.errors import ArrayLayoutError


def _run(make_cluster, directory) -> list[dict]:
    """Runs tests/programs/calls_multi.py as processes 0 and 1; their results."""
    run_two(make_cluster(hosts=2, arena_size=16 * MiB, persist=True), "calls_multi", str(directory))
    return [json.load(open(os.path.join(directory, f"process{i}.json"))) for i in range(2)]


def test_two_jax_processes_call_on_global_arrays(make_cluster, tmp_path):
    """Rows, a 2-D mesh both ways, replicated, an odd shape, out_specs_fn, a method, no array
    inputs, a host claiming every device: each process's shards of the results are right (it
    failed at once before: 'device cpu:2051 belongs to no open colocar cluster'). A non-array result
    is the process's own host's value: its block of the rows."""
    results = _run(make_cluster, tmp_path)
    for i, r in enumerate(results):
        assert r["process"] == i
        assert r["described"] == {"shape": [8, 8], "first": float(i * 64)}, r["described"]
        assert r["reachable"] == 5
        _check_errors(i, r, results[1 - i]["ids"])
    _check_agreement(results)


def _check_agreement(results: list[dict]) -> None:
    """Process 0 (the first of the call) keeps its outputs; process 1 raises when its outputs'
    shapes differ (it returned a global array of another shape before), when process 0's part
    failed, when process 0 never makes the call (after 2 s here), and when it skipped a call
    process 0 made (its next call of the function is compared with that one: other inputs)."""
    first, second = results
    assert first["differ"] == [16, 1] and "differ_errors" not in first, first
    errors = second["differ_errors"]
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert errors[0].startswith("ProcessesDisagree: __main__.data_dependent: the outputs of JAX process 1 ")
    assert "here PyTreeDef(*): float32[16, 2], there PyTreeDef(*): float32[16, 1]. " in errors[0], errors[0]
    assert "failed" not in first and "boom in process 0's host" in first["failed_errors"][0]
    failed = second["failed_errors"]
    assert len(failed) == 2 and "failed" not in second, second
    assert "JAX process 0's part of this call failed: " in failed[0], failed[0]
    assert "boom in process 0's host" in failed[0]
    alone = second["alone"]
    assert "JAX process 0 did not finish the same call (its call number 0) within 2 s" in alone, alone
    assert "out_of_step" not in first, first  # process 0 does not wait for the others
    step = second["out_of_step"]
    assert step.startswith(
        "__main__.skipped_by_process_1: the calls of JAX processes 0 and 1 are out of step"
    ), step
    assert (
        "call number 0 of this function took inputs (float32[16, 8]) in process 0, inputs (int32[8, 5]) "
        in step
    )


def _check_errors(i: int, r: dict, theirs: list[int]) -> None:
    """The errors name this process, the other process and its devices (`theirs`)."""
    elsewhere = r["elsewhere"]
    assert f"array argument args[0] has no shard on JAX process {i} of 2" in elsewhere, elsewhere
    assert f"devices {theirs} of JAX processes [{1 - i}]" in elsewhere, elsewhere
    devices = r["devices_elsewhere"]
    assert f"({theirs}) belongs to JAX process {i} of 2" in devices, devices
    assert "on() takes Host objects of this process's clusters (cluster.hosts[i]), not str" in r["not_a_host"]
    mine = r["ids"]
    uncovered = r["uncovered"]
    assert f"device {mine[2]} of JAX process {i} of 2 belongs to no host of this process's" in uncovered
    assert f"{{'host0': {mine[:2]}}}" in uncovered, uncovered
    for key in ("unreachable", "unreachable_class"):
        assert r[key].startswith("host0 ("), r[key]
        assert f"is not reachable from JAX process {i} of 2: its cluster was closed" in r[key], r[key]


def test_an_output_sharded_beyond_the_calls_hosts_is_named(cluster):
    """One controller: the input lies on host0's devices, out_specs_fn shards the output over
    every device. The error names the devices no host of the call holds."""
    c = cluster.make_current()
    x = jax.device_put(np.arange(8.0), NamedSharding(Mesh(np.array(c.hosts[0].devices), ("d",)), P("d")))
    wide = NamedSharding(c.mesh(("d",)), P("d"))
    f = colocar.colocated(lambda x: x * 2).specialize(
        out_specs_fn=lambda x: jax.ShapeDtypeStruct((16,), x.dtype, sharding=wide)
    )
    with pytest.raises(ArrayLayoutError) as raised:
        f(x)
    assert "puts shards on devices [4, 5, 6, 7], which no host of the call holds" in str(raised.value)
