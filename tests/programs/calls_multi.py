"""One of two JAX processes that make `@colocated` calls on global arrays, each through its own
sidecar.

Run by test_calls_multi.py; argv as in ckpt_processes.py (the directory is where the results
go). Calls on arrays sharded over both processes' 8 devices (rows, a 2-D mesh both ways,
replicated, an odd shape), with out_specs_fn, through a method of a colocated class, without
array inputs, and through a host that claims every process's devices; checks each addressable
shard of every result against numpy on the whole input. Writes process<i>.json: the non-array
results this process got and the errors of a call on another process's devices only, of `.on`
with an unreachable host or a string, and of a call on devices no open cluster covers. Prints
"OK".
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from ckpt_processes import start  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

process, cluster, directory = start()

import colocar  # noqa: E402
from colocar.controller_bridge import processes as processes_module  # noqa: E402
from colocar.errors import ColocarError  # noqa: E402
from colocar.jax_compat import distributed_client  # noqa: E402


@colocar.colocated
def affine(x):
    return x * 2 + 1


@colocar.colocated
def describe(x):
    """The host's block: its shape and first value (a non-array result), and the block doubled."""
    return {"shape": list(x.shape), "first": float(x.flat[0]), "doubled": x * 2}


@colocar.colocated
def row_sums(x):
    return x.sum(axis=1), x - 1


@colocar.colocated
def data_dependent(x):
    """Keeps as many columns as the block's first value says: 1 in process 0, 2 in process 1."""
    return x[:, : int(x.flat[0]) % 3 + 1]


@colocar.colocated
def fails_in_process_0(x):
    if x.flat[0] == 0:
        raise ValueError("boom in process 0's host")
    return x


@colocar.colocated
def only_in_process_1(x):
    return x


@colocar.colocated
def skipped_by_process_1(x):
    return x


@colocar.colocated
def count_up():
    return np.arange(4, dtype=np.int32)


class _Offset:
    def __init__(self, k):
        self.k = k

    def apply(self, x):
        return x + self.k


Offset = colocar.colocated_class(_Offset)


def global_array(full: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


def check(got: jax.Array, expected: np.ndarray, sharding, what: str) -> None:
    """`got` is the global array `expected` (shape, dtype, sharding), shard by shard."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, got.dtype)
    assert got.sharding.is_equivalent_to(sharding, got.ndim), (what, got.sharding, sharding)
    assert len(got.addressable_shards) == 4, (what, len(got.addressable_shards))
    assert got.is_fully_addressable == (jax.process_count() == 1), what
    for shard in got.addressable_shards:
        assert shard.device.process_index == process, (what, shard.device)
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index], err_msg=what)


devices = jax.devices()
line = Mesh(np.array(devices), ("d",))
grid = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
tall = Mesh(np.array(devices).reshape(4, 2), ("data", "model"))
full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
layouts = {
    "rows": NamedSharding(line, P("d")),
    "grid": NamedSharding(grid, P("a", "b")),
    "grid-transposed": NamedSharding(grid, P("b", "a")),
    "rows-replicated-over-model": NamedSharding(tall, P("data")),
    "replicated": NamedSharding(line, P()),
}
for what, sharding in layouts.items():
    x = global_array(full, sharding)
    check(affine(x), full * 2 + 1, sharding, what)
    check(Offset(3.0).apply(x), full + 3, sharding, f"method, {what}")
odd = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
check(affine(global_array(odd, layouts["rows"])), odd * 2 + 1, layouts["rows"], "8x5 rows")

result: dict = {"process": process, "ids": [d.id for d in jax.local_devices()]}
x = global_array(full, layouts["rows"])
described = describe(x)
check(described["doubled"], full * 2, layouts["rows"], "describe")
result["described"] = {k: described[k] for k in ("shape", "first")}

sums = NamedSharding(line, P("d"))
spec = jax.ShapeDtypeStruct((16,), np.float32, sharding=sums)
summed, less = row_sums.specialize(out_specs_fn=lambda x: (spec, x))(x)
check(summed, full.sum(axis=1), sums, "out_specs_fn")
check(less, full - 1, layouts["rows"], "out_specs_fn, second output")

replicated = NamedSharding(line, P())
made = count_up.specialize(
    devices=devices, out_specs_fn=lambda: jax.ShapeDtypeStruct((4,), np.int32, sharding=replicated)
)()
check(made, np.arange(4, dtype=np.int32), replicated, "no array inputs")

# a host that claims every process's devices plans over this process's devices only
address = cluster.hosts[0].address
with colocar.connect([address], token_file=sys.argv[4], devices=[devices]) as wide:
    check(affine(x), full * 2 + 1, layouts["rows"], "a host claiming all devices")
cluster.make_current()

others = [d for d in devices if d.process_index != process]
elsewhere = jax.make_array_from_single_device_arrays(
    (8, 8), NamedSharding(Mesh(np.array(others), ("d",)), P("d")), [], dtype=np.float32
)
try:
    affine(elsewhere)
except ColocarError as e:
    result["elsewhere"] = str(e)
try:
    count_up.specialize(devices=others)()
except ColocarError as e:
    result["devices_elsewhere"] = str(e)

closed = colocar.connect([address], token_file=sys.argv[4])
closed.close()
try:
    affine.on(closed.hosts[0])(1)
except ColocarError as e:
    result["unreachable"] = str(e)
try:
    Offset.on(closed.hosts[0])(1)
except ColocarError as e:
    result["unreachable_class"] = str(e)
# the processes' outputs differ, or process 0's part fails: the others raise
for key, f in (("differ", data_dependent), ("failed", fails_in_process_0)):
    future = f.submit(x)
    for _ in range(2):  # a second result() gives the same outcome
        try:
            result[key] = list(future.result().shape)
        except Exception as e:
            result.setdefault(f"{key}_errors", []).append(f"{type(e).__name__}: {e}")
processes_module.SYNC_TIMEOUT = 2
if process == 1:  # process 0 never makes this call
    try:
        only_in_process_1(x)
    except ColocarError as e:
        result["alone"] = str(e)
    # a process-local array: this process alone, nothing to compare, no waiting
    here = NamedSharding(Mesh(np.array(jax.local_devices()), ("d",)), P("d"))
    got = affine(global_array(full, here))
    assert got.is_fully_addressable and np.array_equal(np.asarray(got), full * 2 + 1)
    distributed_client().key_value_set("calls_multi/alone", "done")
# process 1 skips a call process 0 makes: its next call of the function is out of step
if process == 0:
    check(skipped_by_process_1(x), full, layouts["rows"], "a call process 1 skips")
try:
    skipped_by_process_1(global_array(odd, layouts["rows"]))
except ColocarError as e:
    result["out_of_step"] = str(e)
processes_module.SYNC_TIMEOUT = 300
check(affine(x), full * 2 + 1, layouts["rows"], "after another function's call only process 1 made")

try:
    affine.on("host0")(1)  # type: ignore[arg-type]
except TypeError as e:
    result["not_a_host"] = str(e)
result["reachable"] = affine.on(cluster.hosts[0])(np.arange(3))[-1].item()

cluster.close()  # left open: a host with two of this process's devices
local = jax.local_devices()
with colocar.connect([address], token_file=sys.argv[4], devices=[local[:2]]):
    try:
        affine(x)
    except ColocarError as e:
        result["uncovered"] = str(e)

if process == 0:  # alive until process 1 waited its 2 s in vain (an exited process 0 ends it at once)
    distributed_client().blocking_key_value_get("calls_multi/alone", 120_000)
with open(os.path.join(directory, f"process{process}.json"), "w") as f:
    json.dump(result, f)
print("OK", flush=True)
