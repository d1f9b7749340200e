"""JAX's private API that colocar uses (`colocar.jax_compat`): present in this JAX, doing what
colocar relies on, and used nowhere else. When JAX moves or renames one of them, these tests
fail naming the JAX version and the name, instead of colocar quietly taking a slower path."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from colocar import jax_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_this_jax_has_every_private_name_colocar_uses() -> None:
    problems = jax_compat.missing()
    assert not problems, "\n".join(problems)


def test_missing_names_are_reported_with_the_jax_version(monkeypatch) -> None:
    """The check itself: a name JAX does not have is reported, with the version and the name."""
    monkeypatch.setitem(jax_compat.PRIVATE, "collect_garbage", ("jax._src.lib", "_jax.no_such_function"))
    monkeypatch.setitem(jax_compat.PRIVATE, "distributed_state", ("jax._src.no_such_module", "global_state"))
    problems = jax_compat.missing()
    assert problems == [
        f"JAX {jax.__version__} has no jax._src.lib._jax.no_such_function "
        "(colocar.jax_compat: collect_garbage)",
        f"JAX {jax.__version__} has no jax._src.no_such_module.global_state "
        "(colocar.jax_compat: distributed_state)",
    ]
    assert jax_compat.collect_garbage() is None  # an optional name: the caller takes the public path
    with pytest.raises(jax_compat.JaxCompatError, match=re.escape(f"JAX {jax.__version__} has no")):
        jax_compat.distributed_client()  # a required one: a clear error


def test_batched_put_builds_the_global_array_from_views_in_sharding_order() -> None:
    """The contract the loaders' iterator relies on: `put(aval, sharding, views, devices)` with
    one view per device in `sharding_device_order`, rows placed as the sharding says."""
    devices = jax.devices()[:4]
    sharding = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    order = jax_compat.sharding_device_order(sharding)
    batched = jax_compat.batched_put()
    assert order is not None and batched is not None, jax_compat.missing()
    assert sorted(order, key=lambda d: d.id) == sorted(devices, key=lambda d: d.id)
    whole = np.arange(4 * len(devices) * 3, dtype=np.float32).reshape(4 * len(devices), 3)
    rows = sharding.devices_indices_map(whole.shape)
    views = [whole[rows[d]] for d in order]
    array = batched.put(batched.aval(whole.shape, whole.dtype), sharding, views, order)
    assert array.sharding == sharding
    np.testing.assert_array_equal(np.asarray(array), whole)


def test_collect_garbage_and_the_distributed_client_are_callable() -> None:
    collect = jax_compat.collect_garbage()
    assert callable(collect), jax_compat.missing()
    collect()
    assert jax_compat.distributed_client() is None  # jax.distributed is not initialized here


def test_no_other_module_uses_private_jax_api() -> None:
    private = re.compile(r"jax\._src|xla_client|_addressable_device_assignment|jax\.core\.")
    users = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "colocar").rglob("*.py"))
        if path.name != "jax_compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line) and not line.lstrip().startswith("#")
    ]
    assert not users, "private JAX API outside colocar/jax_compat.py:\n" + "\n".join(users)
