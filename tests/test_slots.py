"""Ring slots come back by reachability alone: a slot is reused only once nothing built on it
(the batch's arrays, their shards, numpy views of them) is alive, and then it does come back."""

from __future__ import annotations

import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loaders_helpers import B, N, features  # jax-free: the pipeline workers import its module
from loaders_helpers import config as loader_config

from colocar import jax_compat, loaders
from colocar.loaders.sampler import IndexSampler


def config(**overrides):
    """The loader tests' range pipeline with one plain transform, endless, and a 2-slot ring
    per host: a slot not given back starves it at once."""
    plain = {"transforms": [{"kind": "map", "fn": features}], "seed": 5, "num_epochs": None, "prefetch": 2}
    return loader_config(**{**plain, **overrides})


def expected(k):
    return IndexSampler(N, B, seed=5, num_epochs=None).batch_indices(k).tolist()


def labels(batch):
    return np.asarray(batch["label"]).tolist()


def address(batch):
    """Where host0's first shard of `x` lives: on the feed path, the memory of host0's slot."""
    return batch["x"].addressable_shards[0].data.unsafe_buffer_pointer()


def in_time(fn, seconds=30.0):
    """fn()'s value, or a failure after `seconds` (a thread: a starved ring would wait)."""
    got = []
    thread = threading.Thread(target=lambda: got.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert got, f"no batch within {seconds} s"
    return got[0]


@pytest.fixture(params=["feed", "calls"])
def path_cluster(request, cluster, grpc_cluster):
    return cluster if request.param == "feed" else grpc_cluster


def test_a_held_batch_keeps_its_values_while_the_ring_turns_many_times(path_cluster):
    with loaders.load(config(prefetch=3), path_cluster, starve_timeout=20) as it:
        held = next(it)
        values = np.asarray(held["x"]).copy()
        pinned = address(held)
        later = []
        for k in range(1, 31):  # the other two slots of each 3-slot ring turn 15 times each
            batch = in_time(lambda: next(it))
            assert labels(batch) == expected(k)
            later.append(address(batch))
            del batch
        assert bool(jnp.array_equal(held["x"], values))  # jnp reads the buffer itself
        if it._fed:  # over a feed the shard is the slot: it was never handed out again
            assert pinned not in later


def test_a_two_slot_ring_never_starves_when_each_batch_is_dropped(path_cluster):
    """The usual loop: the loop variable holds one batch while the next is taken."""
    with loaders.load(config(), path_cluster, starve_timeout=20) as it:
        got = []
        for batch in it:
            got.append(labels(batch))
            if len(got) == 40:
                break
        assert got == [expected(k) for k in range(40)]


def test_without_jaxs_collect_garbage_slots_still_come_back(cluster, monkeypatch):
    """The same mechanism on the public path: JAX's deferred releases run in a gc callback."""
    monkeypatch.setitem(jax_compat.PRIVATE, "collect_garbage", ("jax._src.lib", "_jax.no_such_function"))
    assert jax_compat.collect_garbage() is None
    with loaders.load(config(), cluster, starve_timeout=20) as it:
        assert it._fed
        got = [in_time(lambda: labels(next(it))) for _ in range(20)]
        assert got == [expected(k) for k in range(20)]


@pytest.mark.parametrize("private", [True, False])
def test_release_deferred_lets_go_of_the_views_jax_aliased(private, monkeypatch):
    if not private:
        monkeypatch.setitem(jax_compat.PRIVATE, "collect_garbage", ("jax._src.lib", "_jax.no_such_function"))
    release = jax_compat.release_deferred()
    memory = np.zeros(1 << 20, np.uint8)
    view = memory[4096:]
    array = jax.device_put(view, jax.devices()[0])
    gone = weakref.ref(view)
    del view, array
    release()
    assert gone() is None


def test_released_batches_give_their_slots_back_while_the_program_keeps_them(path_cluster):
    """`it.release(batch)` frees the slots now: a 2-slot ring goes on with every batch kept."""
    with loaders.load(config(), path_cluster, starve_timeout=20) as it:
        kept = []
        for k in range(12):
            kept.append(in_time(lambda: next(it)))
            assert labels(kept[-1]) == expected(k)
            it.release(kept[-1])
        with pytest.raises(RuntimeError, match="deleted"):
            np.asarray(kept[0]["x"])


DERIVED = {
    "shard": lambda x: x.addressable_shards[0].data,  # a jax.Array on the slot's memory
    "numpy view": lambda x: np.asarray(x.addressable_shards[0].data),  # numpy on the slot's memory
    "same-sharding put": lambda x: jax.device_put(x, x.sharding),  # the same buffers
    "jnp op": lambda x: x * 2 + 1,  # a new buffer computed from the slot
}


@pytest.mark.parametrize("kind", list(DERIVED))
def test_arrays_derived_from_a_batch_keep_its_values_and_its_slot(kind, cluster):
    """Anything derived from a dropped batch reads the same values while the ring turns; one that
    aliases the slot keeps the slot out of the ring until it goes, then the slot comes back."""
    with loaders.load(config(), cluster, starve_timeout=20) as it:
        assert it._fed
        batch = next(it)
        pinned = address(batch)
        derived = DERIVED[kind](batch["x"])
        values = np.array(derived, copy=True)
        del batch
        later = [in_time(lambda: address(next(it))) for _ in range(10)]
        if isinstance(derived, np.ndarray):
            np.testing.assert_array_equal(derived, values)
        else:
            assert bool(jnp.array_equal(derived, values))  # jnp reads the buffer; np.asarray is cached
        aliases = kind != "jnp op"
        assert (pinned in later) is not aliases  # an aliasing array keeps its slot; a copy does not
        del derived
        assert pinned in [in_time(lambda: address(next(it))) for _ in range(4)]  # back in the ring


@pytest.mark.parametrize(
    "segments,placed",
    [
        ([(0, 4), (4, 8), (8, 12), (12, 16)], [0, 1, 2, 3]),  # even rows: one strided array a field
        ([(0, 4), (4, 8)], [1, 0, 1]),  # devices in another order, one segment on two devices
        ([(0, 3), (3, 8)], [0, 1]),  # uneven rows: one array a segment
    ],
)
def test_a_batchs_views_are_the_layouts_segments_all_on_one_anchor(segments, placed):
    from colocar.loaders.feed import _slot_views, _view_recipe
    from colocar.loaders.layout import SlotLayout

    layout = SlotLayout.build(segments, {"x": ((5, 3), "float32"), "label": ((), "int32"), "m": ((), "bool")})
    anchor = np.frombuffer(bytearray(np.random.default_rng(0).bytes(layout.nbytes)), np.uint8)  # as in a feed
    views = _slot_views(_view_recipe(layout, placed), anchor)
    assert list(views) == list(layout.fields)
    for name, got in views.items():
        want = [layout.segment_view(anchor, name, s) for s in placed]
        assert [v.shape for v in got] == [w.shape for w in want]
        assert [v.ctypes.data for v in got] == [w.ctypes.data for w in want]
        assert all(v.flags.c_contiguous and v.base is anchor for v in got)
        assert (
            got[0][1:].base is anchor and np.frombuffer(got[0], np.uint8).base is anchor
        )  # derived ones too
        for v, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(v, w)
