"""Remote object lifetimes, the code cache, lazy imports and zero-copy outputs."""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest
from helpers import wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar


@colocar.colocated_class
class Box:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def test_dropping_the_handle_deletes_the_remote_object(cluster):
    host = cluster.hosts[0]
    before = host.stats()["objects"]
    box = Box.on(host)(np.ones(1 << 16))
    assert host.stats()["objects"] == before + 1
    address = box._address  # no handle: calls through it do not keep the object alive
    assert address.call("get", (), {}).run().shape == (1 << 16,)
    del box
    gc.collect()
    wait_for(lambda: _deleted(address), "the remote object to be deleted")  # this one, whatever
    # other tests' objects the shared sidecar is deleting meanwhile


def _deleted(address) -> bool:
    try:
        address.call("get", (), {}).run()
    except colocar.ObjectNotFoundError as e:  # a call through a stale handle says so
        assert "Box.get" in str(e), e
        return True
    return False


def test_detached_object_outlives_its_session_and_is_found_by_name(cluster):
    host = cluster.hosts[1]
    token = open(cluster.token_file).read()
    with colocar.connect([host.address], token=token) as other:
        Box.on(other.hosts[0], name="writer", ttl=60)("still here")
    found = host.object("writer")  # the creating session is gone
    assert found.get() == "still here"
    found.delete()
    with pytest.raises(colocar.ColocarError, match="writer"):
        host.object("writer")


def test_detached_object_expires_after_its_ttl(cluster):
    host = cluster.hosts[0]
    Box.on(host, name="short-lived", ttl=0.5)(1)
    wait_for(lambda: _missing(host, "short-lived"), "the detached object to expire")


def _missing(host, name):
    try:
        host.object(name)
    except colocar.ColocarError:
        return True
    return False


def test_code_is_resent_when_the_sidecar_does_not_know_it(cluster):
    @colocar.colocated
    def fresh():
        return "ran"

    conn = cluster.hosts[0].connection
    code_hash, _ = fresh._code.pickled()
    conn.session.known_code.add(code_hash)  # pretend it was sent before (as after a sidecar restart)
    assert fresh.on(cluster.hosts[0])() == "ran"
    conn.session.known_code.add(code_hash)
    assert fresh.on(cluster.hosts[0]).submit().result() == "ran"


def test_sidecar_does_not_import_jax_until_shipped_code_does():
    with colocar.local_cluster(hosts=1, arena_size=16 << 20, processes=0) as c:

        @colocar.colocated
        def loaded():
            import sys

            return sorted(m for m in ("jax", "grain") if m in sys.modules)

        assert loaded.on(c.hosts[0])() == []


def test_output_arrays_alias_the_arena(cluster):
    """device_put of an aligned arena view aliases it on CPU: zero copies on the way out."""
    mesh = cluster.mesh(("data",))
    x = jax.device_put(np.zeros((8, 4096), np.float32), NamedSharding(mesh, P("data")))

    @colocar.colocated
    def ones_like(x):
        out = colocar.shm.empty(x.shape, x.dtype)
        out[...] = 1
        return out

    y = ones_like(x)
    arenas = {h.connection.blocks.arena for h in cluster.hosts}
    aliased = [
        any(a.contains(s.data.unsafe_buffer_pointer(), s.data.nbytes) for a in arenas)
        for s in y.addressable_shards
    ]
    assert all(aliased), aliased
    np.testing.assert_array_equal(np.asarray(y), 1)
