"""The demo's training script: a small MLP on the digits, data-parallel over every host's devices,
its input pipeline on the sidecars, snapshots in host memory, checkpoints in a bucket, and
recovery onto the surviving hosts when one is lost (`colocar.elastic`).

Runs in the controller. `train(cluster, settings)` is all a job needs: against a local cluster
(the demo) or real sidecars (`colocar.connect()`) and a real bucket only `cluster` and
`settings.storage` change. `monitor` (optional) sees every step, for the demo's display.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import colocar
from colocar.checkpoint import CheckpointManager


@dataclass
class Settings:
    """What to train and where: the pipeline config, the checkpoint URL (directory or gs://)."""

    config: str
    storage: str
    steps: int = 400
    hidden: int = 128
    learning_rate: float = 1e-2
    snapshot_every: int = 5  # host-memory snapshots (cheap: a memcpy per host)
    save_every: int = 50  # checkpoints to storage (async: written by the sidecars)
    min_hosts: int = 2
    faults: list[Any] = field(default_factory=list)  # colocar.elastic.faults, for drills


def init_params(key: jax.Array, hidden: int) -> dict[str, Any]:
    sizes = [64, hidden, hidden, 10]
    keys = jax.random.split(key, len(sizes) - 1)
    return {
        f"layer{i}": {
            "w": jax.random.normal(k, (m, n), jnp.float32) * jnp.sqrt(2.0 / m),
            "b": jnp.zeros((n,), jnp.float32),
        }
        for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
    }


def logits(params: dict[str, Any], x: jax.Array) -> jax.Array:
    layers = [params[k] for k in sorted(params)]
    for layer in layers[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ layers[-1]["w"] + layers[-1]["b"]


class Model:
    """The MLP and its optimizer; the state is {"params", "opt"} (optax's state as a dict of
    its leaves, so that snapshots and checkpoints see plain containers)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.optimizer = optax.adam(settings.learning_rate)
        params = jax.eval_shape(lambda: init_params(jax.random.key(0), settings.hidden))
        self.opt_tree = jax.tree.structure(jax.eval_shape(self.optimizer.init, params))
        self.step = jax.jit(self._step)

    def init(self, mesh: Mesh) -> dict[str, Any]:
        params = init_params(jax.random.key(0), self.settings.hidden)
        state = {"params": params, "opt": self._pack(self.optimizer.init(params))}
        return jax.device_put(state, NamedSharding(mesh, P()))  # replicated: data parallel

    def abstract(self, mesh: Mesh) -> dict[str, Any]:
        """The state's shapes with their shardings on `mesh`: where a restore puts them."""
        replicated = NamedSharding(mesh, P())
        shapes = jax.eval_shape(lambda: self.init_unplaced())
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), shapes)

    def init_unplaced(self) -> dict[str, Any]:
        params = init_params(jax.random.key(0), self.settings.hidden)
        return {"params": params, "opt": self._pack(self.optimizer.init(params))}

    def _pack(self, opt_state: Any) -> dict[str, Any]:
        return {f"{i:03d}": leaf for i, leaf in enumerate(jax.tree.leaves(opt_state))}

    def _unpack(self, packed: dict[str, Any]) -> Any:
        return jax.tree.unflatten(self.opt_tree, [packed[k] for k in sorted(packed)])

    def _step(self, state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
        def loss_fn(params: dict[str, Any]) -> jax.Array:
            out = logits(params, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(out, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = self.optimizer.update(grads, self._unpack(state["opt"]), state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": self._pack(opt)}, loss


def accuracy(params: dict[str, Any], images: np.ndarray, labels: np.ndarray) -> float:
    """The share of `images` the model labels right (on the controller)."""
    params = jax.device_get(params)
    predicted = np.asarray(jnp.argmax(logits(params, jnp.asarray(images)), axis=-1))
    return float(np.mean(predicted == labels))


def train(cluster: colocar.Cluster, settings: Settings, monitor: Any = None) -> tuple[Any, Any]:
    """Trains `settings.steps` steps on `cluster`; returns (params, the elastic manager, closed).

    After a lost host the attempt function runs again on the survivors: the state comes back
    from the newest snapshot in the survivors' RAM (else the newest checkpoint), and the loader
    resumes at that step's record, so the run sees the record stream of an uninterrupted one."""
    model = Model(settings)
    checkpoints = CheckpointManager(settings.storage, cluster, max_to_keep=2)
    elastic = colocar.elastic.Manager(
        cluster,
        checkpoints,
        snapshot_every=settings.snapshot_every,
        save_every=settings.save_every,
        faults=settings.faults,
    )

    @elastic.run(min_hosts=settings.min_hosts)
    def attempt(hosts: list[Any], devices: list[Any]) -> Any:
        mesh = Mesh(np.array(devices), ("data",))
        state, start = elastic.restore(target=model.abstract(mesh), init=lambda: model.init(mesh))
        data = elastic.load(settings.config, mesh)  # the pipeline runs on the sidecars
        for step in range(start, settings.steps):
            batch = next(data)
            state, loss = model.step(state, batch)
            if monitor is not None:  # before elastic.step, which may end the attempt here
                monitor.step(elastic, step, loss, batch["id"])
            elastic.step(step, {"state": state, "data": data})  # snapshot / save when due
        data.close()
        return state["params"]

    with elastic:
        params = attempt()
    return params, elastic
