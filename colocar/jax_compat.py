"""The private JAX API colocar uses, in one place (runs in the controller; imports JAX lazily).

JAX has no public way to do these four things, so colocar reaches into its internals here and
nowhere else (a test checks that no other module names `jax._src` or `xla_client`):

* `collect_garbage`: JAX's release of the Python objects its freed CPU buffers held (the numpy
  views a buffer aliased), which it otherwise defers to garbage-collection callbacks; the
  loaders' iterator runs it once a step (`release_deferred`) to give ring slots back promptly.
* `batched_put`: the C++ behind `jax._src.interpreters.pxla.batched_device_put` (one call builds
  a global array from per-device views) and the abstract value type it takes.
* `sharding_device_order`: the order of a sharding's addressable devices in which
  `batched_put` wants its views.
* `distributed_client`: the key-value store of `jax.distributed` (Orbax uses it too).

The first three are optional: when this JAX lacks one, the function returns None and the caller
takes the public path (slower, same results). The last is required for multi-controller
checkpoints and raises `JaxCompatError` naming the JAX version. `missing()` lists what this JAX
lacks; `tests/test_jax_compat.py` fails with that list (JAX version and names) when JAX moves or
renames one, instead of colocar silently taking the slow path.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

# what colocar uses -> (module, attribute path) where this JAX keeps it
PRIVATE: dict[str, tuple[str, str]] = {
    "collect_garbage": ("jax._src.lib", "_jax.collect_garbage"),
    "batched_device_put": ("jax._src.lib", "xla_client.batched_device_put"),
    "ShapedArray": ("jax.core", "ShapedArray"),
    "distributed_state": ("jax._src.distributed", "global_state"),
}
SHARDING_DEVICE_ORDER = "_addressable_device_assignment"  # a private attribute of JAX's shardings


class JaxCompatError(ImportError):
    """This JAX lacks a private name colocar needs; the message names the version and the name."""


class BatchedPut(NamedTuple):
    """`put(aval, sharding, views, devices) -> jax.Array`, and `aval(shape, dtype)` for it."""

    put: Any
    aval: Any


def lookup(name: str) -> Any | None:
    """The object `PRIVATE[name]` names in this JAX, or None if JAX has no such thing."""
    module, path = PRIVATE[name]
    try:
        value: Any = importlib.import_module(module)
        for part in path.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError):
        return None
    return value


def describe(name: str) -> str:
    """What is missing, for an error: the JAX version and the full name."""
    import jax

    module, path = PRIVATE.get(name, ("jax.sharding.NamedSharding", name))
    return f"JAX {jax.__version__} has no {module}.{path} (colocar.jax_compat: {name})"


def collect_garbage() -> Any | None:
    """JAX's `collect_garbage()`, or None (then only Python's collector runs JAX's callbacks)."""
    return lookup("collect_garbage")


def release_deferred() -> Callable[[], Any]:
    """A function that runs JAX's deferred releases now: the Python objects (numpy views) that
    its freed buffers held are let go. JAX's `collect_garbage` (~0.1 us when idle), or in a JAX
    without it a young-generation collection, whose callback JAX uses to run the same releases
    (~1 us; that path is public)."""
    collect = collect_garbage()
    return collect if collect is not None else _young_collection


def _young_collection() -> None:
    gc.collect(0)  # JAX runs its deferred releases in a gc callback, at every collection


def batched_put() -> BatchedPut | None:
    """JAX's batched device put and its aval type, or None (then use `jax.device_put`)."""
    put, aval = lookup("batched_device_put"), lookup("ShapedArray")
    return None if put is None or aval is None else BatchedPut(put, aval)


def sharding_device_order(sharding: Any) -> list[Any] | None:
    """`sharding`'s addressable devices in the order `batched_put` takes views, or None."""
    order = getattr(sharding, SHARDING_DEVICE_ORDER, None)
    return None if order is None else list(order)


def distributed_client() -> Any:
    """The `jax.distributed` client (None before `jax.distributed.initialize()`)."""
    state = lookup("distributed_state")
    if state is None or not hasattr(state, "client"):
        raise JaxCompatError(describe("distributed_state") + ": multi-controller checkpoints need it")
    return state.client


def missing() -> list[str]:
    """One line per private name this JAX lacks (empty when colocar finds everything)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    problems = [describe(name) for name in PRIVATE if lookup(name) is None]
    state = lookup("distributed_state")
    if state is not None and not hasattr(state, "client"):
        problems.append(describe("distributed_state") + " with a .client")
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), PartitionSpec())
    if sharding_device_order(sharding) is None:
        problems.append(describe(SHARDING_DEVICE_ORDER))
    return problems
