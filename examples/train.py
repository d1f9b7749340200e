"""A small training program that runs unchanged in colocar's topologies (README "Multi-controller JAX").

It connects to its sidecars, runs a colocated call on a global array, loads a pipeline, takes a
few SGD steps of a linear model, saves a checkpoint halfway, restores it and replays the second
half from it, which must give the same state and batches. The last line holds checksums of the
final state and of the batches seen: equal in every topology (the same batches, the same sums).

    python examples/train.py --local 2 --ckpt /tmp/ckpt     # one controller, 2 sidecars it starts
    COLOCAR_SIDECARS=h0:7070,h1:7070 COLOCAR_TOKEN_FILE=token python examples/train.py --ckpt gs://B/P
    # multi-controller JAX, one process per host with its own sidecar, as k8s/examples run it:
    JAX_COORDINATOR_ADDRESS=h0:8476 COLOCAR_NUM_HOSTS=2 JOB_COMPLETION_INDEX=0 \
        COLOCAR_SIDECARS=127.0.0.1:7070 COLOCAR_TOKEN_FILE=token python examples/train.py --ckpt gs://B/P
    # on Slurm, one task per node (README "Run on Slurm"):
    colocar slurm render --nodes 4 -- python examples/train.py --ckpt /shared/ckpt > job.sh; sbatch job.sh
"""

from __future__ import annotations

import argparse
import hashlib
import os

# A controller without accelerators (the single-controller variant's) splits its CPU devices over
# the hosts: 16 of them. Only JAX's CPU platform reads this flag.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import colocar  # noqa: E402
from colocar import loaders  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402

LR = 0.125
GRID = 1024.0  # parameters on a 1/1024 grid, binary features: every sum is exact, so the result
# is bit-identical however the devices' partial sums are added (one process, or several)
TRUE_W = np.array([1.0, -2.0, 3.0, 2.0], np.float32)


def make_example(record):
    """Record i of the data set, made in the sidecars' pipeline workers: 4 binary features."""
    i = int(record["index"])
    x = np.array([(i >> j) & 1 for j in range(4)], np.float32)
    return {"x": x, "y": np.float32(x @ TRUE_W + 1)}


@colocar.colocated
def set_bits(x):
    """Runs in the sidecar of each host holding rows of `x`, on its block (numpy)."""
    return x.sum(axis=1, keepdims=True)  # the same rank: sharded as x is


@jax.jit
def sgd_step(params, batch):
    def loss(p):
        return 0.5 * jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

    return jax.tree.map(lambda p, g: jnp.round((p - LR * g) * GRID) / GRID, params, jax.grad(loss)(params))


@jax.jit
def batch_digest(batch, bits):
    """An exact integer naming the batch's rows, in order (`bits` from the colocated call)."""
    rows = batch["x"] @ jnp.array([1.0, 2.0, 4.0, 8.0]) + 16 * bits[:, 0] + 256 * batch["y"]
    return jnp.sum(rows * jnp.arange(1, rows.shape[0] + 1)).astype(jnp.int32)


def train(params, it, steps, digests):
    for _ in range(steps):
        batch = next(it)
        digests.append(int(value(batch_digest(batch, set_bits(batch["x"])))))
        params = sgd_step(params, batch)
    return params


def value(x):
    """A replicated global array's value (under multi-controller JAX no process holds it all)."""
    return np.asarray(x.addressable_data(0))


def checksum(tree) -> str:
    leaves = jax.tree.leaves(jax.tree.map(lambda x: value(x).tobytes(), tree))
    return hashlib.sha256(b"".join(leaves)).hexdigest()[:16]


def init_jax() -> None:
    """Joins jax.distributed when this is one process of several (k8s/examples and
    `colocar slurm run` set these)."""
    if "JOB_COMPLETION_INDEX" in os.environ:  # GPU slices on Kubernetes
        jax.distributed.initialize(
            os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["COLOCAR_NUM_HOSTS"]),
            process_id=int(os.environ["JOB_COMPLETION_INDEX"]),
        )
    elif "JAX_COORDINATOR_ADDRESS" in os.environ:  # Slurm: JAX reads the process id and count itself
        jax.distributed.initialize()
    elif "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):  # multi-host TPU slices: JAX finds its peers
        jax.distributed.initialize()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", help="an empty directory or gs:// URL (default: $COLOCAR_BUCKET/train)")
    parser.add_argument("--local", type=int, default=0, help="start N local sidecars (one controller)")
    parser.add_argument("--no-shm", action="store_true", help="bulk data through gRPC streams")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    args.ckpt = args.ckpt or (
        os.environ["COLOCAR_BUCKET"] + "/train" if "COLOCAR_BUCKET" in os.environ else None
    )
    if not args.ckpt:
        parser.error("give --ckpt DIRECTORY (or set COLOCAR_BUCKET)")
    return args


def main() -> None:
    args = parse_args()
    init_jax()
    shm = not args.no_shm
    # COLOCAR_SIDECARS: this process's own sidecar (multi-controller) or every host's
    cluster = colocar.local_cluster(hosts=args.local, shm=shm) if args.local else colocar.connect(shm=shm)
    with cluster:
        mesh = Mesh(np.array(jax.devices()), ("data",))  # global: every process's devices
        config = {
            "source": {"kind": "range", "n": 1024},
            "transforms": [{"kind": "map", "fn": make_example}],
            "global_batch_size": 2 * jax.device_count(),
            "num_epochs": None,  # repeat
            "prefetch": 2,
        }
        zeros = {"w": np.zeros(4, np.float32), "b": np.zeros(1, np.float32)}
        replicated = NamedSharding(mesh, P())
        params = jax.tree.map(
            lambda z: jax.make_array_from_callback(z.shape, replicated, z.__getitem__), zeros
        )
        half, digests, replayed = args.steps // 2, [], []
        with CheckpointManager(args.ckpt, cluster) as mngr:
            with loaders.load(config, cluster, mesh) as it:
                params = train(params, it, half, digests)
                mngr.save(half, {"params": params}, metadata={"data": it.get_state()})
                params = train(params, it, args.steps - half, digests)
            mngr.wait()
            # as a restarted job would: the checkpoint, then the batches after it
            target = jax.tree.map(
                lambda z: jax.ShapeDtypeStruct(z.shape, z.dtype, sharding=replicated), zeros
            )
            restored = mngr.restore(half, target={"params": target})["params"]
            with loaders.load(config, cluster, mesh) as it:
                it.set_state(mngr.metadata(half)["data"])
                restored = train(restored, it, args.steps - half, replayed)
        assert checksum(restored) == checksum(params) and replayed == digests[half:], "replay differs"
        batches = hashlib.sha256(str(digests).encode()).hexdigest()[:16]
        print(
            f"train.py: process {jax.process_index()} of {jax.process_count()}: {args.steps} steps, "
            f"state {checksum(params)}, batches {batches}, replayed from step {half}: same"
        )


if __name__ == "__main__":
    main()
