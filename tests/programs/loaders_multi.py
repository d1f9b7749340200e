"""One of two JAX processes that load the same pipeline over a global mesh, each from its own
sidecar.

Run by test_loaders_multi.py; argv as in ckpt_processes.py (the directory is where the
results go). Writes process<i>.pkl: each batch's addressable rows (`first`: batches 0..2,
`continued`: 3..4 after get_state, `resumed`: 3..4 from a fresh iterator given that state;
batch 0 on the default mesh, and with two hosts in each process), the states, the keys left
in jax.distributed's store, the warning for a process-local mesh, and the errors of: get_state
at different batches, other seeds, get_state in process 0 only, a mesh no sidecar of this
process covers. Prints "OK".
"""

import json
import os
import pickle
import sys
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
# the transforms come from loaders_helpers; the sidecars get this sys.path when we connect
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from ckpt_processes import start  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from loaders_helpers import config  # noqa: E402

process, cluster, directory = start()

import colocar  # noqa: E402
from colocar import loaders  # noqa: E402
from colocar.errors import ColocarError  # noqa: E402
from colocar.jax_compat import distributed_client  # noqa: E402

# both processes' devices; the batch is split over "data", each row range on two devices
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
cfg = config(batch_axes=["data"])


def rows(batch: dict) -> dict:
    """Per field: this process's rows as {first row: numpy copy} (replicas once)."""
    out: dict = {}
    for name, array in batch.items():
        assert array.shape[0] == cfg["global_batch_size"] and not array.is_fully_addressable
        for shard in array.addressable_shards:
            out.setdefault(name, {})[shard.index[0].start or 0] = np.array(shard.data)
    return out


result: dict = {"process": process}
with loaders.load(cfg, cluster, mesh) as it:
    result["first"] = [rows(next(it)) for _ in range(3)]
    result["state"] = state = it.get_state()
    result["continued"] = [rows(next(it)) for _ in range(2)]
    result["state_after"] = it.get_state()
    if process == 0:  # the leader deleted the first get_state's keys once all checked the second
        kept = distributed_client().key_value_dir_get(f"{it._agreement._prefix}/get_state/")
        result["kept_keys"] = sorted(k for k, _ in kept)
with loaders.load(cfg, cluster, mesh) as it:
    it.set_state(json.loads(json.dumps(state)))
    result["resumed"] = [rows(next(it)) for _ in range(2)]
    if process == 1:
        next(it)  # one batch ahead of process 0
    try:
        it.get_state()
    except loaders.ProcessesDisagree as e:
        result["disagree"] = str(e)

try:  # the processes' pipelines differ: their batches would not fit together
    loaders.load(config(batch_axes=["data"], seed=7 + process), cluster, mesh)
except loaders.ProcessesDisagree as e:
    result["other_seed"] = str(e)
with loaders.load(config(), cluster, sync_timeout=2) as it:  # the default mesh: all processes'
    result["default_mesh"] = rows(next(it))
    if process == 0:  # process 1 never asks
        try:
            it.get_state()
        except loaders.ProcessesDisagree as e:
            result["alone"] = str(e)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaders.load(cfg, cluster, Mesh(np.array(jax.local_devices()).reshape(2, 2), ("data", "model"))).close()
result["local_mesh_warnings"] = [str(w.message) for w in caught]

local = jax.local_devices()
with colocar.connect([cluster.hosts[0].address], token_file=sys.argv[4], devices=[local[:2]]) as half:
    try:
        loaders.load(cfg, half, mesh)
    except ColocarError as e:
        result["uncovered"] = str(e)
    result["uncovered_ids"] = [d.id for d in local[2:]]
# two "hosts" in each process (two sessions to its sidecar, two devices each): four pipelines
address = cluster.hosts[0].address
with colocar.connect([address, address], token_file=sys.argv[4]) as two:
    with loaders.load(cfg, two, mesh) as it:
        result["two_hosts_each"] = rows(next(it))
        assert [h["host"] for h in it.stats()["hosts"]] == ["host0", "host1"], it.stats()

with open(os.path.join(directory, f"process{process}.pkl"), "wb") as f:
    pickle.dump(result, f)
cluster.close()
print("OK", flush=True)
